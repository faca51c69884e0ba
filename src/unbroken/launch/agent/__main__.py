"""`python -m unbroken.launch.agent --coordinator HOST:PORT --node N` (see `loop.main`)."""

from unbroken.launch.agent.loop import main

raise SystemExit(main())
