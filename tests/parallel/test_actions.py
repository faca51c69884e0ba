"""The action text form: every action prints and parses back to itself."""

import pytest

from unbroken.parallel import Action, ActionKind, parse_action


@pytest.mark.parametrize(
    "text",
    [
        "0F3",
        "2B1",
        "2W1",
        "1SEND_F2->r5",
        "2RECV_F2<-r4",
        "3SEND_B0->r1",
        "2RECV_B0[1/2]<-r7",
        "0SEND_F4[3/4]->r12",
        "REDUCE_GRAD",
        "OPT_STEP",
    ],
)
def test_text_form_round_trips(text: str) -> None:
    action = parse_action(text)
    assert str(action) == text
    assert parse_action(str(action)) == action


def test_fields_of_a_chunked_send() -> None:
    a = parse_action("1SEND_F2[1/2]->r5")
    assert a == Action(ActionKind.SEND_F, 1, 2, peer=5, chunk=1, num_chunks=2)
    assert a.is_comm and a.is_send and not a.is_compute


@pytest.mark.parametrize(
    "text", ["", "F3", "0X3", "1SEND_F2<-r5", "1RECV_F2->r5", "1SEND_F2", "0F3->r1", "0F1[0/2]"]
)
def test_malformed_text_is_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        parse_action(text)


def test_constructor_checks_fields() -> None:
    with pytest.raises(ValueError, match="peer"):
        Action(ActionKind.SEND_F, 0, 0)
    with pytest.raises(ValueError, match="chunk"):
        Action(ActionKind.SEND_F, 0, 0, peer=1, chunk=2, num_chunks=2)
    with pytest.raises(ValueError, match="no stage"):
        Action(ActionKind.OPT_STEP, 0, 0)
    with pytest.raises(ValueError, match="stage and a micro-batch"):
        Action(ActionKind.F)
