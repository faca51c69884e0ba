"""A reply with more fds than one message can carry (a GPU region has one fd per page) arrives
whole and in order."""

from __future__ import annotations

import os
import socket
import threading

from unbroken.state._wire import FDS_PER_MESSAGE, recv_reply, send_frame


def test_many_fds_arrive_in_order_with_their_frame():
    n = FDS_PER_MESSAGE + 57  # two messages' worth
    fds = []
    for i in range(n):
        fd = os.memfd_create(f"wire-{i}")
        os.ftruncate(fd, i + 1)  # the size tells which fd it is
        fds.append(fd)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sender = threading.Thread(target=send_frame, args=(a, {"ok": True, "n": n}, fds))
        sender.start()
        reply, got = recv_reply(b)
        sender.join()
        assert reply == {"ok": True, "n": n}
        assert [os.fstat(fd).st_size for fd in got] == list(range(1, n + 1))
        a.sendall(b"")  # nothing left in the stream: the next reply starts clean
        send_frame(a, {"ok": True})
        assert recv_reply(b) == ({"ok": True}, [])
    finally:
        for fd in fds + locals().get("got", []):
            os.close(fd)
        a.close()
        b.close()
