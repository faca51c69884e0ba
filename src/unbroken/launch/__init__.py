"""Processes of a job: coordinator (store, event log, recovery), one agent per node
(spawns and supervises local trainers, detects dead or hung ones, executes coordinator commands),
and trainer processes (one per rank). See ARCHITECTURE.md "Processes".
"""
