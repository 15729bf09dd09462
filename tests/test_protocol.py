"""The actor-learner protocol's typed messages: each survives the wire as it was sent, and a malformed one
is refused with an error that names the field and what was expected."""

from __future__ import annotations

import pytest

from tianji.runtime.shared.protocol import (
    ORDERS,
    TO_ACTOR,
    TO_LEARNER,
    Credit,
    FragmentNotice,
    Heartbeat,
    Hello,
    LearnerRestarted,
    Probe,
    Stop,
    Weights,
    parse,
)
from tianji.runtime.transport.wire import WireError, pack_header, unpack_header

SHM = {"shm": "/dev/shm/tianji-x-actor0-1", "slot_bytes": 64, "fields": [["obs", "<f4", [4]]]}
MESSAGES = [
    (Hello(actor=0, slots=2), TO_LEARNER),
    (Hello(role="evaluator"), TO_LEARNER),
    (Hello(actor=3, slots=4).with_resync([1], [2, 0]), TO_LEARNER),
    (FragmentNotice(1, 0, 3, 7, 12, 2048, SHM), TO_LEARNER),
    (FragmentNotice(1, 2, 3, 7, 12, 2048), TO_LEARNER),
    (Probe(3, 1024), TO_LEARNER),
    (Weights(5, 1), TO_ACTOR),
    (Weights(5, 1, resync=True), TO_ACTOR),
    (Credit(1, 4, 0), TO_ACTOR),
    (Probe(3), TO_ACTOR),
    (Stop(), ORDERS),
    (Heartbeat(), ORDERS),
    (LearnerRestarted(2, ({"fragments": "tcp://a:1", "weights": "tcp://a:2"},)), ORDERS),
]


@pytest.mark.parametrize("message, expected", MESSAGES, ids=lambda m: getattr(m, "kind", ""))
def test_every_message_survives_the_wire(message, expected):
    assert parse(unpack_header(pack_header(message.header())), expected) == message


def test_the_wire_format_is_the_one_peers_of_the_last_release_speak():
    assert Hello(actor=0, slots=2).header() == {"kind": "hello", "actor": 0, "slots": 2}
    assert Hello(actor=0).with_resync([1], [2, 0]).header() == {
        "kind": "hello",
        "actor": 0,
        "resync": {"credits": [1], "sent": [0, 2]},
    }
    assert Credit(1, 4, 0).header() == {"kind": "credit", "slot": 1, "min_version": 4, "epoch": 0}
    notice = FragmentNotice(1, 0, 3, 7, 12, 2048, SHM)
    assert notice.header() == {
        **SHM,
        "kind": "fragment",
        "slot": 1,
        "epoch": 0,
        "actor": 3,
        "seq": 7,
        "version": 12,
        "env_steps": 2048,
    }
    assert notice.in_shared_memory and not FragmentNotice(1, 0, 3, 7, 12, 2048).in_shared_memory


@pytest.mark.parametrize(
    "header, expected, says",
    [
        (
            {"kind": "fragment", "slot": 0, "epoch": 0, "actor": 0, "seq": 0, "version": 0},
            TO_LEARNER,
            "'env_steps' must be an int",
        ),
        (
            {"kind": "fragment", "slot": -1, "epoch": 0, "actor": 0, "seq": 0, "version": 0, "env_steps": 1},
            TO_LEARNER,
            "'slot' must be an int >= 0, got -1",
        ),
        (
            {"kind": "fragment", "slot": True, "epoch": 0, "actor": 0, "seq": 0, "version": 0, "env_steps": 1},
            TO_LEARNER,
            "'slot' must be an int",
        ),
        ({"kind": "hello", "actor": 0, "slots": 5000}, TO_LEARNER, r"'slots' must be an int in \[1, 1024\]"),
        ({"kind": "hello", "actor": "zero"}, TO_LEARNER, "'actor' must be an int"),
        ({"kind": "hello", "actor": 0, "resync": {"sent": "all"}}, TO_LEARNER, "'sent' must be a list of slot numbers"),
        ({"kind": "hello", "role": 7}, TO_LEARNER, "'role' must be a string"),
        ({"kind": "probe"}, TO_LEARNER, "probe: 'n' must be an int"),
        ({"kind": "credit", "slot": 0, "epoch": 0}, TO_ACTOR, "credit: 'min_version' must be an int"),
        ({"kind": "weights", "epoch": 0}, TO_ACTOR, "weights: 'version' must be an int"),
        (
            {"kind": "learner_restarted", "epoch": 1, "learners": [{"fragments": 5}]},
            ORDERS,
            "'learners' must be a list",
        ),
        ({"kind": "credit", "slot": 0, "min_version": 0, "epoch": 0}, TO_LEARNER, "unexpected message kind 'credit'"),
        ({"kind": "surprise"}, ORDERS, "unexpected message kind 'surprise'"),
    ],
)
def test_a_malformed_message_names_its_field_and_what_was_expected(header, expected, says):
    with pytest.raises(WireError, match=says):
        parse(header, expected)
