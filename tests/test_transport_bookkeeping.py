"""The MQTT coordinator transport's bookkeeping without a broker: which devices are believably offline
around outages of its own connection (on a fake clock), and which retained messages it publishes, and
publishes again after a reconnection. The broker restarts of test_mqtt_protocol.py and
test_mqtt_restarts.py prove the same end to end."""

from __future__ import annotations

from fedge.common.messages import Message
from fedge.mqtt.chunking import RetainedAssembler, frame_kind
from fedge.mqtt.retained import RetainedState
from fedge.mqtt.status_book import StatusBook
from fedge.mqtt.topics import FleetTopics


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def at(self, now: float) -> FakeClock:
        self.now = now
        return self


def _book(clock: FakeClock) -> StatusBook:
    return StatusBook(offline_confirm_s=1.0, status_grace_s=30.0, clock=clock)  # the transport's defaults


# -- the status book ------------------------------------------------------------------------------------
def test_an_offline_counts_once_it_is_confirmed_and_until_the_device_is_back() -> None:
    clock = FakeClock()
    book = _book(clock)
    book.connection_back()  # the first connection: no outage to end
    book.record("d1", True)
    book.record("d2", True)
    clock.at(10.0)
    book.record("d2", False)  # d2's last-will
    assert book.online() == {"d1"} and book.offline() == set()
    clock.at(10.5)
    assert book.offline() == set()  # not yet offline_confirm_s old
    clock.at(11.0)
    assert book.offline() == {"d2"}
    book.record("d2", True)  # it reconnected
    assert book.offline() == set() and book.online() == {"d1", "d2"}


def test_all_offline_is_every_device_in_offline() -> None:
    """What the coordinator asks whenever no update is waiting: the same answer as the whole offline set's."""
    clock = FakeClock()
    book = _book(clock)
    book.connection_back()
    for d in ("d1", "d2", "d3"):
        book.record(d, True)
    clock.at(10.0)
    book.record("d2", False)
    book.record("d3", False)
    for now in (10.5, 11.0):
        clock.at(now)
        for group in (["d2", "d3"], ["d1", "d2"], ["d4"], [], ["d3"]):
            assert book.all_offline(group) == all(d in book.offline() for d in group), (now, group)
    assert book.all_offline(["d2", "d3"]) and not book.all_offline(["d2", "d4"])  # d4: no status at all


def test_last_wills_around_an_outage_count_only_after_the_grace_period() -> None:
    """A broker shutting down sends every device's last-will just before it drops the coordinator."""
    clock = FakeClock()
    book = _book(clock)
    for d in ("d1", "d2", "d3"):
        book.record(d, True)
    clock.at(50.0)
    book.record("d3", False)  # a real dropout, long before the outage
    clock.at(99.5)
    book.record("d1", False)  # within offline_confirm_s before the outage began
    clock.at(100.0)
    book.connection_lost()
    clock.at(100.2)
    book.record("d2", False)  # during the outage (a persistent broker's kept will)
    clock.at(1000.0)
    assert book.offline() == {"d3"}  # while the outage lasts, its wills are not believed, however old
    clock.at(1005.0)
    book.connection_back()
    clock.at(1010.0)
    book.record("d1", True)  # d1 comes back within the grace period
    clock.at(1034.9)
    assert book.offline() == {"d3"}
    clock.at(1035.0)  # status_grace_s after the reconnection: d2 did not come back
    assert book.offline() == {"d2", "d3"} and book.online() == {"d1"}


def test_an_offline_after_the_grace_period_counts_as_usual() -> None:
    clock = FakeClock(100.0)
    book = _book(clock)
    book.connection_lost()
    clock.at(105.0)
    book.connection_back()
    clock.at(140.0)
    book.record("d1", False)
    assert book.offline() == set()
    clock.at(141.0)
    assert book.offline() == {"d1"}


def test_a_second_drop_soon_after_a_reconnection_keeps_the_first_outages_wills_unbelieved() -> None:
    clock = FakeClock(100.0)
    book = _book(clock)
    book.connection_lost()
    clock.at(102.0)
    book.record("d1", False)
    clock.at(105.0)
    book.connection_back()
    clock.at(120.0)
    book.connection_lost()  # within the first outage's window, [99, 135]
    clock.at(120.5)
    assert book.offline() == set()  # the will at 102 is outside the second window but inside the first
    clock.at(121.0)
    book.connection_back()
    clock.at(134.9)
    assert book.offline() == set()
    clock.at(135.0)  # the first window is over and the second, [119, 151], does not hold 102: believed
    assert book.offline() == {"d1"}


def test_a_repeated_drop_during_an_outage_does_not_start_another() -> None:
    clock = FakeClock(99.5)
    book = _book(clock)
    book.record("d1", False)
    clock.at(100.0)
    book.connection_lost()
    clock.at(101.5)
    book.connection_lost()  # still the same outage (a second one would leave the first without an end)
    clock.at(105.0)
    book.connection_back()
    clock.at(134.9)
    assert book.offline() == set()
    clock.at(135.0)
    assert book.offline() == {"d1"}


# -- the retained state ---------------------------------------------------------------------------------
TOPICS = FleetTopics("f1")
CHUNK = 1024


def _reassemble(items: list[tuple[str, bytes]], artifact: str) -> bytes | None:
    """What a device subscribed to the artifact rebuilds from these retained messages."""
    asm = RetainedAssembler(1 << 20)
    whole = None
    for topic, payload in items:
        parsed = TOPICS.parse_global(topic)
        assert parsed is not None and parsed.artifact == artifact
        whole = asm.on_root(payload) if parsed.part is None else asm.on_part(payload)
    return whole


def test_a_small_global_is_one_retained_message() -> None:
    state = RetainedState(TOPICS, CHUNK)
    update = state.set_global("protos", b"x" * 100)
    assert update.publish == [(TOPICS.global_("protos"), b"x" * 100)] and update.clear == []


def test_a_large_global_is_its_parts_then_the_manifest_and_a_shorter_one_clears_the_rest() -> None:
    state = RetainedState(TOPICS, CHUNK)
    data = bytes(range(256)) * 12  # 3072 bytes: 3 parts
    update = state.set_global("g", data)
    assert [t for t, _ in update.publish] == [TOPICS.global_part("g", i) for i in range(3)] + [TOPICS.global_("g")]
    assert frame_kind(update.publish[-1][1]) == "manifest" and update.clear == []
    assert _reassemble(update.publish, "g") == data
    shorter = state.set_global("g", data[:1500])  # 2 parts: part 2 of the previous version goes
    assert len(shorter.publish) == 3 and shorter.clear == [TOPICS.global_part("g", 2)]
    whole = state.set_global("g", b"small")
    assert whole.publish == [(TOPICS.global_("g"), b"small")]
    assert whole.clear == [TOPICS.global_part("g", 0), TOPICS.global_part("g", 1)]
    assert state.set_global("g", b"small again").clear == []


def test_after_a_reconnection_every_global_then_the_round_under_a_fresh_id() -> None:
    state = RetainedState(TOPICS, CHUNK)
    assert state.after_reconnect().globals == [] and state.after_reconnect().round is None
    state.set_global("a", b"old a")
    big = state.set_global("b", b"y" * 2500)
    state.set_global("a", b"new a")  # only the latest version is republished
    descriptor = Message("round", "coordinator", 3, fleet="f1", info={"phase": "train", "run": "r1"})
    state.set_round(descriptor.to_bytes())
    again = state.after_reconnect()
    assert again.globals == [(TOPICS.global_("a"), b"new a"), *big.publish]
    assert again.round is not None and again.round_number == 3 and again.round == state.round
    fresh = Message.from_bytes(again.round)
    assert fresh.msg_id != descriptor.msg_id
    assert (fresh.kind, fresh.sender, fresh.round, fresh.fleet, fresh.info) == \
        ("round", "coordinator", 3, "f1", descriptor.info)
    # Each reconnection announces the round under yet another id: devices resend every time.
    second = state.after_reconnect()
    assert second.round is not None and Message.from_bytes(second.round).msg_id not in (fresh.msg_id,
                                                                                          descriptor.msg_id)


def test_an_async_version_is_re_announced_with_its_tasks_and_the_recovery_flag() -> None:
    """Asynchronous mode (issue 47): the re-announcement after a reconnection names the outstanding tasks and carries
    ``recovery``, which makes devices whose task it lists resend within the same coordinator session; the
    announcements the engine makes itself do not carry it."""
    state = RetainedState(TOPICS, CHUNK)
    info = {"run": "r1", "session": "s1", "round": {"round": 4, "assigned": {"d1": 3, "d2": 4}}}
    state.set_round(Message("round", "coordinator", 4, fleet="f1", info=info).to_bytes())
    again = state.after_reconnect()
    assert (again.round_number, again.tasks) == (4, {"d1": 3, "d2": 4})
    assert again.round is not None and Message.from_bytes(again.round).info == {**info, "recovery": True}
    synchronous = RetainedState(TOPICS, CHUNK)
    synchronous.set_round(Message("round", "coordinator", 2, info={"run": "r1"}).to_bytes())
    assert synchronous.after_reconnect().tasks is None


def test_no_round_is_re_announced_after_the_run_ended_or_when_unreadable() -> None:
    state = RetainedState(TOPICS, CHUNK)
    state.set_global("a", b"a")
    state.set_round(Message("round", "coordinator", 1).to_bytes())
    state.set_round(None)  # end_run deleted it
    again = state.after_reconnect()
    assert again.round is None and again.globals == [(TOPICS.global_("a"), b"a")]
    state.set_round(b"not a message")
    again = state.after_reconnect()
    assert again.round is None and again.round_number is None and again.globals == [(TOPICS.global_("a"), b"a")]
