"""The round machine without a swarm: ``DecentralizedSGD`` built by its own factories, but for its averager.

Every part is the product's, built and wired by the optimizer's ``_make_*`` methods; ``Peer`` overrides only
``_make_averager`` (``HivemindsSide``), ``_make_starvation_monitor`` (never starved) and ``start`` (no scheduler
thread). Every round runs on a real hivemind ``StepControl`` with real ``MPFuture`` trigger and cancel futures. What
hivemind's averager process would do to a step (form the group, run the AllReduce, write the average into the
buffers, end the step) is done here by ``HivemindsSide``, in this process, when the test says so; the test calls
``scheduler.tick()`` itself. So each scenario is exact and takes milliseconds. The same machine with real peers:
test_decentralized_sgd and the others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import hivemind
import numpy as np
import pytest
import torch
from dsgd_swarm import wait_until
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture, get_dht_time

from decentralized_sgd import DecentralizedSGD
from decentralized_sgd.outer import OuterOptimizer, OuterSettings
from decentralized_sgd.outliers import Summary, WeightSketch
from decentralized_sgd.rounds import Round, RoundBook
from decentralized_sgd.rounds import RoundState as S
from decentralized_sgd.scheduler import RoundSettings
from decentralized_sgd.tensors import AveragedTensors, FlatStaging, ResultSlots, StepBoundaryMarks

MATE = PeerID(os.urandom(34))  # the groupmate hivemind's side brings
DRIFTER = PeerID(os.urandom(34))  # a third groupmate, in the tests that bring one themselves


def new_step() -> StepControl:
    """A step as hivemind's ``DecentralizedAverager.step(wait=False, require_trigger=True)`` hands it back."""
    trigger, cancel = MPFuture(), MPFuture()  # first: hivemind's MPFuture backend starts with a plain one
    step = StepControl(
        scheduled_time=get_dht_time(),
        deadline=get_dht_time() + 60,
        allow_retries=False,
        weight=1.0,
        data_for_gather=b"",
    )
    step.attach(trigger, cancel)
    return step


class HivemindsSide:
    """What the trainer's process sees of hivemind's averager process: the steps it was asked for, its buffers (and
    their lock, which its AllReduce takes), its health. ``form``, ``finish`` and ``fail`` do to a step what the
    averager process would."""

    client_mode = False

    def __init__(self, size: int, sketch: WeightSketch, own: PeerID):
        self.sketch, self.own = sketch, own  # the groupmate's weight summary is made with the swarm's sketch, as ours
        self.buffers_ = [torch.zeros(size)]
        self._lock = threading.Lock()
        self.steps: list[tuple[StepControl, dict]] = []  # (step, what we gathered)
        self.alive, self.pid, self.exitcode = True, os.getpid(), None
        self.allow_state_sharing, self.state_sharing_priority = True, 0.0

    # --- called by the parts ---
    def start_in_background(self, timeout: float) -> None:
        pass

    def is_alive(self) -> bool:
        return self.alive

    def get_group_bits(self, wait: bool) -> MPFuture:
        answer = MPFuture()
        answer.set_result("")
        return answer

    def kill_now(self) -> None:
        self.alive = False

    def shutdown(self) -> None:
        self.alive = False

    def start_step(self, *, scheduled_time: float, deadline: float, gather: dict, timeout: float) -> StepControl:
        step = new_step()
        step.stage = AveragingStage.LOOKING_FOR_GROUP
        self.steps.append((step, gather))
        return step

    @contextlib.contextmanager
    def buffers(self, timeout: float) -> Iterator[list[torch.Tensor]]:
        assert self._lock.acquire(timeout=timeout)
        try:
            yield self.buffers_
        finally:
            self._lock.release()

    def allreduce_stamps(self) -> tuple[float, float]:
        return 0.0, 0.0  # none of its own: the rounds keep the times the scheduler saw

    def early_part_refused_at(self) -> float:
        return 0.0

    def load_state_from_peers(self, timeout: float) -> None:
        return None  # nobody shares a state here

    # --- what the averager process does ---
    def form(self, index: int) -> None:
        self.steps[index][0].stage = AveragingStage.AWAITING_TRIGGER

    def finish(self, index: int, mate: list[torch.Tensor]) -> None:
        """The AllReduce of step ``index`` with one groupmate whose values are ``mate``: the buffers become the mean."""
        step, gathered = self.steps[index]
        assert step.triggered and not step.cancelled()
        mate_summary = Summary(np.asarray(self.sketch(mate)), int(gathered["summary"]["step"]))
        with self.buffers(10.0) as buffers:
            step.stage, step.began_allreduce = AveragingStage.RUNNING_ALLREDUCE, True
            for buffer, theirs in zip(buffers, mate, strict=True):
                buffer.add_(theirs).div_(2)
        step.stage = AveragingStage.FINISHED
        step.set_result({self.own: gathered, MATE: {"summary": mate_summary.to_wire()}})

    def fail(self, index: int, error: BaseException) -> None:
        step = self.steps[index][0]
        step.stage = AveragingStage.FINISHED
        step.set_exception(error)


class Peer(DecentralizedSGD):
    """A DecentralizedSGD around one parameter vector, built by its own factories with two replaced: its averager is
    ``HivemindsSide``, and it never starves (no sampler process). ``start`` starts no thread: the test ticks."""

    def __init__(self, dht: hivemind.DHT, settings: RoundSettings, size: int = 64, **kwargs):
        self.param = torch.nn.Parameter(torch.ones(size))
        self.hivemind: HivemindsSide | None = None
        optimizer = torch.optim.SGD([self.param], lr=0.1)
        super().__init__(optimizer, dht, prefix="unit", settings=settings, **TIMEOUTS, **kwargs)
        self.book, self.tensors = self.round_book, self.averaged_tensors
        self.supervisor, self.scheduler = self._supervisor, self._scheduler

    def _make_averager(self) -> HivemindsSide:
        if self.hivemind is None:  # one for the peer's life: a restart gets it back
            self.hivemind = HivemindsSide(self.param.numel(), self.guard.sketch, self.peer_id)
        return self.hivemind

    def _make_starvation_monitor(self) -> None:
        return None

    def start(self) -> None:
        self._supervisor.start()

    def train_step(self, change: float = -0.1) -> int:
        """One local step that moves every parameter by ``change``, then the step boundary (what step() does):
        returns how many rounds it applied."""
        with self.lock, torch.no_grad():
            self.param.add_(change)
        return self.on_step_end(batch_size=16)

    def start_and_trigger(self, index: int) -> Round:
        """A step boundary, a tick that starts round ``index``, hivemind forming its group, a tick that fills and
        triggers it."""
        self.train_step()
        self.scheduler.tick()
        self.hivemind.form(index)
        self.scheduler.tick()
        assert self.round(index).state is S.TRIGGERED
        return self.round(index)

    def round(self, index: int) -> Round:
        return next(r for r in [*self.book.rounds] if r.index == index)

    def state_of(self, index: int) -> str:
        """A round's state: in flight, or its record's once resolved and retired."""
        in_flight = [r for r in self.book.rounds if r.index == index]
        if in_flight:
            return in_flight[0].state.name
        return next(record["state"] for record in self.book.records if record["round"] == index)


@pytest.fixture(scope="module")
def dht() -> Iterator[hivemind.DHT]:
    """One real DHT for every peer of this module: they never meet (their averager is HivemindsSide)."""
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


@pytest.fixture
def make_peer(dht: hivemind.DHT) -> Iterator[Callable[..., Peer]]:
    """Peers whose rounds still in flight are closed at the end (as shutdown does: hivemind is told of each)."""
    peers: list[Peer] = []

    def make(settings: RoundSettings, outer: OuterSettings | None = None, size: int = 64, **kwargs) -> Peer:
        peers.append(Peer(dht, settings, size=size, outer=outer, **kwargs))
        return peers[-1]

    yield make
    for peer in peers:
        peer.book.close("test over")


TIMEOUTS = dict(min_matchmaking_time=0.5, next_chunk_timeout=0.5, allreduce_timeout=10.0)
FAST = RoundSettings(averager_timeout=10.0)


def test_a_round_goes_through_every_state_and_the_delta_rule_keeps_the_local_step_made_during_it(make_peer):
    peer = make_peer(FAST)
    peer.train_step()  # a step boundary: the scheduler may start a round
    peer.scheduler.tick()
    assert peer.state_of(0) == "LOOKING" and len(peer.hivemind.steps) == 1
    assert peer.hivemind.steps[0][1]["summary"]["step"] == 1  # our weight summary went with the join request

    peer.hivemind.form(0)
    peer.scheduler.tick()  # formed → filled at once from the last step boundary → triggered
    r = peer.round(0)
    assert r.state is S.TRIGGERED and r.step_at_snapshot == 1 and r.control.triggered
    snapshot = peer.param.detach().clone()  # 0.9 everywhere
    assert torch.equal(peer.hivemind.buffers_[0], snapshot)  # what goes into the AllReduce is the fill's values

    peer.train_step()  # a local step during the AllReduce: 0.8
    mate = [snapshot + 0.002]
    peer.hivemind.finish(0, mate)
    peer.scheduler.tick()
    assert peer.state_of(0) == "DONE"
    assert peer.train_step() == 1  # applied at the next boundary: w + (averaged - snapshot), minus that step's 0.1
    assert torch.allclose(peer.param.detach(), torch.full((64,), 0.7 + 0.001)), peer.param
    peer.scheduler.tick()
    record = peer.book.records[0]
    assert record["state"] == "APPLIED" and record["applied"] and record["group_size"] == 2
    assert record["step_at_snapshot"] == 1 and record["staleness_steps"] == 2  # snapshot at step 1, applied at 3
    assert peer.counters["rounds_applied"] == 1 and peer.counters["fills"] == 1


def test_without_the_delta_rule_the_average_overwrites_the_local_step(make_peer):
    peer = make_peer(RoundSettings(**{**FAST.__dict__, "delta_rule": False}))
    peer.start_and_trigger(0)
    snapshot = peer.param.detach().clone()
    peer.train_step()
    peer.hivemind.finish(0, [snapshot + 0.002])
    peer.scheduler.tick()
    peer.train_step()
    assert torch.allclose(peer.param.detach(), snapshot + 0.001)  # the two local steps since the fill are lost


def test_the_next_matchmaking_starts_while_the_allreduce_runs_and_only_after_a_step_boundary(make_peer):
    peer = make_peer(FAST)
    peer.start_and_trigger(0)
    assert peer.round(0).state is S.TRIGGERED
    peer.scheduler.tick()
    assert len(peer.hivemind.steps) == 1  # no step boundary since round 0 started: the trainer may be stalled
    peer.train_step()
    peer.scheduler.tick()
    assert len(peer.hivemind.steps) == 2 and peer.round(1).state is S.LOOKING  # pipelined: round 0 still runs
    assert peer.round(0).state is S.TRIGGERED

    serial = make_peer(RoundSettings(**{**FAST.__dict__, "pipeline": False}))
    serial.start_and_trigger(0)
    serial.train_step()
    serial.scheduler.tick()
    assert len(serial.hivemind.steps) == 1  # without pipelining: only once round 0 is over


def test_an_ssp_wait_is_a_step_boundary_whose_round_it_fills_and_applies(make_peer):
    """``max_staleness=1``: the trainer's second step without a sync waits for a round. The wait releases
    ``dsgd.lock`` and is woken whenever a round changes: the round that starts during it is filled with the waiting
    trainer's values (step 2), and its update is applied by the wait itself, which then returns."""
    peer = make_peer(FAST, max_staleness=1)
    peer.train_step()  # step 1: within the bound
    applied: list[int] = []
    trainer = threading.Thread(target=lambda: applied.append(peer.train_step()))
    trainer.start()
    try:
        wait_until(lambda: peer.trainer.waiting, 30, "the trainer's SSP wait")
        boundaries = peer.trainer.boundaries
        peer.scheduler.tick()  # round 0 starts (the trainer passed a boundary): a change, so the wait wakes
        wait_until(lambda: peer.trainer.boundaries > boundaries and peer.trainer.waiting, 30, "a wake, and back")
        peer.hivemind.form(0)
        peer.scheduler.tick()  # filled under dsgd.lock, which the waiting trainer released
        r = peer.round(0)
        assert r.state is S.TRIGGERED and r.step_at_snapshot == 2 and trainer.is_alive()
        snapshot = peer.param.detach().clone()
        peer.hivemind.finish(0, [snapshot + 0.002])
        peer.scheduler.tick()  # DONE: the wait wakes, applies it and returns
        trainer.join(30)
    finally:
        peer.book.close("unblock the trainer if the test failed")
        trainer.join(30)
    assert applied == [1] and torch.allclose(peer.param.detach(), snapshot + 0.001)
    assert peer.counters["ssp_waits"] == 1 and peer.counters["ssp_timeouts"] == 0
    assert peer.trainer.boundaries - boundaries <= 3  # one wake per round change: started, triggered, done
    peer.scheduler.tick()
    record = peer.book.records[0]
    assert record["applied"] and record["step_at_apply"] == 2 and record["staleness_steps"] == 0


def test_a_round_formed_while_the_trainer_holds_its_lock_is_cancelled_after_next_chunk_timeout(make_peer):
    peer = make_peer(FAST)
    peer.train_step()
    peer.scheduler.tick()
    peer.hivemind.form(0)
    held, release = threading.Event(), threading.Event()

    def stalled_step() -> None:  # a trainer stuck inside its optimizer step
        with peer.trainer.lock:
            held.set()
            release.wait(60)

    stalled = threading.Thread(target=stalled_step)
    stalled.start()
    try:
        assert held.wait(10)
        peer.scheduler.tick()
        assert peer.round(0).state is S.FORMED  # the fill could not take the lock: the next tick tries again
        wait_until(lambda: peer.scheduler.tick() or peer.state_of(0) == "CANCELLED", 60, "the unfilled round's end")
    finally:
        release.set()
        stalled.join(10)
    record = peer.book.records[0]
    assert "not filled in time" in record["error"] and peer.hivemind.steps[0][0].cancelled()  # hivemind was told
    assert record["t_triggered"] is None  # never triggered: no AllReduce that nobody would join
    peer.scheduler.tick()
    assert len(peer.hivemind.steps) == 1  # no new round until the trainer passed a step boundary
    peer.train_step()
    peer.scheduler.tick()
    assert len(peer.hivemind.steps) == 2


def test_a_failed_averager_fails_the_rounds_in_flight_and_a_finished_update_is_still_applied(make_peer):
    peer = make_peer(FAST)
    peer.start_and_trigger(0)
    snapshot = peer.param.detach().clone()
    peer.hivemind.finish(0, [snapshot + 0.002])
    peer.train_step()  # a boundary: round 1 may start (round 0 ended but its update waits for the next boundary)
    peer.scheduler.tick()  # round 0 → DONE; round 1 starts looking
    assert peer.state_of(0) == "DONE" and peer.state_of(1) == "LOOKING"
    peer.supervisor.failed("was stopped by the test")
    peer.scheduler.tick()
    assert peer.state_of(1) == "FAILED" and peer.counters["averager_failures"] == 1
    assert peer.state_of(0) == "DONE"  # its update lives in its slot, outside the averager
    assert peer.train_step() == 1
    assert peer.counters["averager_restarts"] == 1  # restarted at once (a first failure): a new averager


def test_hivemind_ending_a_step_with_an_error_fails_the_round_with_that_error(make_peer):
    peer = make_peer(FAST)
    peer.train_step()
    peer.scheduler.tick()
    peer.hivemind.fail(0, TimeoutError("could not find a group"))
    peer.scheduler.tick()
    assert peer.state_of(0) == "FAILED" and "could not find a group" in peer.book.records[0]["error"]
    assert peer.counters["rounds_no_group"] == 1  # failed before a group formed


def test_non_finite_local_values_go_in_with_weight_zero_and_the_round_is_discarded(make_peer):
    peer = make_peer(FAST)
    peer.train_step()
    peer.scheduler.tick()
    peer.hivemind.form(0)
    with torch.no_grad():
        peer.param[3] = float("nan")
    peer.scheduler.tick()
    r = peer.round(0)
    assert r.state is S.TRIGGERED and r.weight == 0.0 and r.control.weight == 0.0
    assert torch.count_nonzero(peer.hivemind.buffers_[0]) == 0  # zeros, not the NaN
    peer.hivemind.finish(0, [torch.ones(64)])
    peer.scheduler.tick()
    peer.scheduler.tick()
    assert peer.state_of(0) == "DISCARDED" and peer.counters["rounds_skipped_local_nonfinite"] == 1
    assert torch.isnan(peer.param[3])  # our own values are kept (the trainer's to handle)


def test_a_much_larger_update_than_the_summaries_predict_is_refused(make_peer):
    peer = make_peer(FAST)
    peer.start_and_trigger(0)
    peer.hivemind.finish(0, [peer.param.detach() + 0.002])  # a normal round first: the update check's history
    peer.train_step()
    peer.scheduler.tick()  # round 0 DONE, round 1 looking
    assert peer.train_step() == 1
    peer.hivemind.form(1)
    peer.scheduler.tick()
    assert peer.round(1).state is S.TRIGGERED
    snapshot = peer.param.detach().clone()
    # the mate's summary says it is where we are; its values in the AllReduce are far away (a bad or lying peer)
    step, gathered = peer.hivemind.steps[1]
    with peer.hivemind.buffers(10.0) as buffers:
        step.began_allreduce = True
        buffers[0].add_(100.0)
    step.set_result({peer.peer_id: gathered, MATE: gathered})
    peer.scheduler.tick()
    peer.scheduler.tick()
    assert peer.state_of(1) == "DISCARDED" and peer.counters["rounds_rejected_large_update"] == 1
    assert peer.counters["rounds_applied"] == 1
    peer.train_step()
    assert torch.allclose(peer.param.detach(), snapshot - 0.1)  # our own weights, not the far average


def test_an_update_that_outgrew_what_the_summaries_predict_is_refused(make_peer):
    """test_robust_peers' drifting peer under load, with its numbers (27 values: the sketch is exact). The drifter's
    summary, taken 6 steps (x1.05 each) into its drift, passed the rule: its reference was 7 still steps older, so
    it moved 0.34 / 13 = 2.6% of |w| per step, under the 3% floor. Its values were copied 11 steps later (x1.05^17):
    the update, 3.8 times what the summaries predicted, was within 4 * expected and moved the others by 43%."""
    peer = make_peer(FAST, size=27)
    peer.train_step(0.0)
    peer.scheduler.tick()
    peer.hivemind.form(0)
    peer.scheduler.tick()
    peer.hivemind.finish(0, [peer.param.detach().clone()])  # a round that changes nothing: history [0]
    peer.train_step(0.0)
    peer.scheduler.tick()  # round 0 DONE, round 1 looking
    assert peer.train_step(0.0) == 1
    peer.hivemind.form(1)
    peer.scheduler.tick()
    assert peer.round(1).state is S.TRIGGERED
    step, gathered = peer.hivemind.steps[1]
    own = Summary.from_wire(gathered["summary"], peer.vetting.sketch.size).point
    healthy = Summary(own, 26, own, 13)
    drifter = Summary(1.05**6 * own, 26, own, 13)
    with peer.hivemind.buffers(10.0) as buffers:  # our snapshot (1.0), the healthy mate's, the drifter's 1.05^17
        step.began_allreduce = True
        buffers[0].mul_((1.05**17 + 2) / 3)
    mates = {MATE: {"summary": healthy.to_wire()}, DRIFTER: {"summary": drifter.to_wire()}}
    step.set_result({peer.peer_id: gathered, **mates})
    peer.scheduler.tick()
    peer.scheduler.tick()
    assert peer.state_of(1) == "DISCARDED" and peer.counters["rounds_rejected_large_update"] == 1
    assert not peer.book.records[1]["outliers"]  # the rule let the drifter in: the update check is what is left
    peer.train_step(0.0)
    assert torch.equal(peer.param.detach(), torch.ones(27))  # our own weights, not 1.43 of them


def test_the_round_book_moves_several_rounds_at_once_and_records_them_in_order():
    param = torch.nn.Parameter(torch.zeros(4))
    tensors = AveragedTensors(
        torch.optim.SGD([param], lr=0.1), None, average_buffers=False, average_optimizer_state=False
    )
    marks = StepBoundaryMarks(tensors.local())
    book = RoundBook(ResultSlots(lambda: FlatStaging(tensors.local(), marks, torch.float32)), None, False, "me")
    counters = book.counters
    rounds = [Round(i, new_step(), time.time(), 0) for i in range(4)]
    with book.lock:
        book.rounds.extend(rounds)
        rounds[1].form(1, 1, False)
        rounds[2].form(1, 1, False)
        rounds[2].fill(1, 16, book.slots.take(), 0)
        rounds[3].form(1, 1, False)
        rounds[3].fill(1, 16, book.slots.take(), 0)
        rounds[3].trigger(1.0, local_nonfinite=False)
        with pytest.raises(AssertionError, match="not a transition"):
            rounds[0].fill(1, 16, [], 0)  # LOOKING → FILLED skips FORMED: a bug
    assert not rounds[3].cancel("too late")  # once triggered, hivemind may have committed: never cancelled

    assert book.cancel_untriggered("starved of CPU", (S.LOOKING,)) == 1
    assert rounds[0].state is S.CANCELLED and rounds[0].control.cancelled()
    assert book.fail_in_flight("averager failed") == 3  # FORMED, FILLED, TRIGGERED
    with book.lock:
        book.retire(step=5)
    assert [record["round"] for record in book.records] == [0, 1, 2, 3]
    assert [record["state"] for record in book.records] == ["CANCELLED", "FAILED", "FAILED", "FAILED"]
    assert counters["rounds_cancelled"] == 1 and counters["rounds_failed"] == 3  # they had formed
    assert book.slots.free() == ResultSlots.count  # the slots came back

    late = [Round(i, new_step(), time.time(), 0) for i in range(4, 7)]
    with book.lock:
        book.rounds.extend(late)
        for r in late[1:]:
            r.form(5, 5, False)
            r.fill(5, 16, book.slots.take(), 0)
            r.trigger(1.0, local_nonfinite=False)
        late[2].finish(["me", "mate"])
    book.state_reloaded(step=6)  # a donor's state replaced the parameters
    assert late[1].stale and late[2].state is S.DISCARDED and late[0].state is S.LOOKING
    book.close("shut down")
    assert late[0].state is S.CANCELLED and late[1].state is S.FAILED and not book.rounds
    assert [record["round"] for record in book.records] == [0, 1, 2, 3]  # nothing recorded after the run is over


def test_a_download_torch_could_not_start_keeps_our_state_and_other_errors_still_raise(make_peer) -> None:
    """hivemind's MPFuture asks torch's shared-memory manager for memory; on an overloaded machine it can time out
    (pytorch/pytorch#2482: seen in a test swarm's heal) before anything was sent: the download did not happen, and the
    trainer goes on (a heal is tried again when a group refuses us next); any other error still raises."""
    peer = make_peer(FAST)
    before = peer.param.detach().clone()

    def manager_timed_out(timeout: float) -> None:
        raise RuntimeError("Shared memory manager connection has timed out\nException raised from recv at ...")

    peer.hivemind.load_state_from_peers = manager_timed_out
    assert peer.state_transfer.load(peer.hivemind, timeout=1.0, accept=None) is None
    assert torch.equal(peer.param.detach(), before)

    def broken(timeout: float) -> None:
        raise RuntimeError("something else")

    peer.hivemind.load_state_from_peers = broken
    with pytest.raises(RuntimeError, match="something else"):
        peer.state_transfer.load(peer.hivemind, timeout=1.0, accept=None)


def test_the_scheduler_logs_a_timed_out_shared_memory_manager_as_overload_and_other_errors_as_a_bug(
    make_peer, caplog
) -> None:
    """A tick that raised torch's shared-memory timeout (pytorch/pytorch#2482; seen in the scheduler's thread at a
    load of 20-37 on 2 cores) is an overloaded machine: a warning that says so, every time. Any other error is a bug,
    logged once with its traceback. Neither ends the thread's loop."""
    peer = make_peer(FAST)
    raised = [RuntimeError("Shared memory manager connection has timed out"), ValueError("a bug")] * 2

    def tick() -> None:
        raise raised.pop(0)

    peer.scheduler.tick = tick
    with caplog.at_level(logging.WARNING, logger="decentralized_sgd.scheduler"):
        for _ in range(4):
            peer.scheduler.tick_and_log_errors()
    overload = [r for r in caplog.records if "pytorch/pytorch#2482" in r.getMessage()]
    bugs = [r for r in caplog.records if "please report" in r.getMessage()]
    assert [r.levelno for r in overload] == [logging.WARNING] * 2 and not any(r.exc_info for r in overload)
    assert len(bugs) == 1 and bugs[0].levelno == logging.ERROR and "ValueError('a bug')" in bugs[0].getMessage()


# --- the outer optimizer (outer.py) on the rounds' averages ---

NESTEROV = OuterSettings(momentum=0.5, lr=0.8, nesterov=True)


def averaged_round(peer: Peer, index: int, mate_offset: float, change: float = -0.1) -> float:
    """Round ``index`` as a swarm runs it: a step boundary and a fill (snapshot s), one local step during the
    AllReduce, a groupmate at ``s + mate_offset``, the update applied at the next boundary (after one more local
    step); every local step moves the weights by ``change``. Returns the snapshot's value (every parameter holds
    the same one)."""
    peer.train_step(change)
    peer.scheduler.tick()
    peer.hivemind.form(index)
    peer.scheduler.tick()
    r = peer.round(index)
    assert r.state is S.TRIGGERED, r.error
    snapshot = float(peer.param[0])
    peer.train_step(change)  # during the AllReduce: rides on top of the new anchor
    peer.hivemind.finish(index, [torch.full((64,), snapshot + mate_offset)])
    peer.scheduler.tick()
    assert peer.state_of(index) == "DONE", r.error
    assert peer.train_step(change) == 1
    return snapshot


def test_the_outer_step_moves_the_anchor_by_nesterov_momentum_and_keeps_the_local_steps_over_two_rounds(make_peer):
    peer = make_peer(FAST, NESTEROV)
    b, a = 0.5, 0.8
    s0 = averaged_round(peer, 0, 0.002)  # local steps of -0.1: s0 = 0.9
    m0 = s0 + 0.001  # the group's mean
    d0 = 1.0 - m0  # the progress from the first anchor (the initial weights)
    u0 = d0
    x1 = 1.0 - a * (d0 + b * u0)
    assert np.isclose(s0, 0.9)
    assert torch.allclose(peer.outer.anchor[0], torch.full((64,), x1))
    assert torch.allclose(peer.outer.buffer[0], torch.full((64,), u0))
    # the delta rule: the two local steps since the snapshot ride on top of the new anchor
    assert torch.allclose(peer.param.detach(), torch.full((64,), x1 - 0.2)), (peer.param[0], x1 - 0.2)

    s1 = averaged_round(peer, 1, 0.004)
    assert np.isclose(s1, x1 - 0.3)  # one more local step before round 1's fill
    m1 = s1 + 0.002
    d1 = x1 - m1  # counts the local steps made during round 0 and since: each enters one pseudo-gradient
    u1 = b * u0 + d1
    x2 = x1 - a * (d1 + b * u1)
    assert torch.allclose(peer.outer.anchor[0], torch.full((64,), x2))
    assert torch.allclose(peer.outer.buffer[0], torch.full((64,), u1))
    assert torch.allclose(peer.param.detach(), torch.full((64,), x2 - 0.2))
    peer.scheduler.tick()
    records = peer.book.records
    assert [record["state"] for record in records] == ["APPLIED", "APPLIED"] and peer.outer.steps == 2
    assert np.isclose(records[1]["outer_step_norm"], 8 * a * abs(d1 + b * u1), rtol=1e-4)  # sqrt(64) = 8


def test_slowmo_without_momentum_at_lr_1_is_the_plain_delta_rule(make_peer):
    plain, outer = make_peer(FAST), make_peer(FAST, OuterSettings(momentum=0.0, lr=1.0000001))
    for index, offset in enumerate((0.002, -0.004, 0.006)):
        averaged_round(plain, index, offset, change=-0.01)
        averaged_round(outer, index, offset, change=-0.01)
    assert torch.allclose(plain.param.detach(), outer.param.detach(), atol=1e-5)


def test_the_update_check_vets_the_plain_average_before_the_outer_step(make_peer):
    """An outer step far larger than the plain update passes (the check vets the group's average, which the
    summaries predict); an average far from what the summaries predict is still refused with the outer step on."""
    peer = make_peer(FAST, OuterSettings(momentum=0.9, lr=3.0, nesterov=True))
    for index in range(3):  # outer steps over 10x the plain updates: all accepted
        averaged_round(peer, index, 0.0002, change=-0.01)
    assert peer.counters["rounds_applied"] == 3 and peer.counters["rounds_rejected_large_update"] == 0
    last = peer.book.records[-1] if peer.book.records else peer.round(2).extra
    assert last["outer_step_norm"] > 10 * last["update_norm"]
    anchor = peer.outer.anchor[0].clone()
    r = peer.start_and_trigger(3)
    step, gathered = peer.hivemind.steps[3]
    with peer.hivemind.buffers(10.0) as buffers:  # the mate's summary says it is where we are; its values are not
        step.began_allreduce = True
        buffers[0].add_(100.0)
    step.set_result({peer.peer_id: gathered, MATE: gathered})
    peer.scheduler.tick()
    assert peer.state_of(3) == "DISCARDED" and peer.counters["rounds_rejected_large_update"] == 1, r.error
    assert torch.equal(peer.outer.anchor[0], anchor) and peer.outer.steps == 3  # a refused round moves no anchor


def test_the_outer_state_survives_a_checkpoint_and_a_resumed_peer_steps_as_the_uninterrupted_one(make_peer, tmp_path):
    running = make_peer(FAST, NESTEROV)
    averaged_round(running, 0, 0.0002, change=-0.01)
    averaged_round(running, 1, -0.0004, change=-0.01)
    path = tmp_path / "checkpoint.torch"
    torch.save({"param": running.param.detach().clone(), "outer": running.outer.state_dict()}, path)
    checkpoint = torch.load(path)

    resumed, forgetful = make_peer(FAST, NESTEROV), make_peer(FAST, NESTEROV)
    for peer in (resumed, forgetful):
        with torch.no_grad():
            peer.param.copy_(checkpoint["param"])
    resumed.outer.load_state_dict(checkpoint["outer"])
    forgetful.outer.reset(forgetful.tensors.params)  # what a checkpoint without outer state gives
    assert resumed.outer.steps == 2 and torch.equal(resumed.outer.buffer[0], running.outer.buffer[0])
    for peer in (running, resumed, forgetful):
        averaged_round(peer, 2 if peer is running else 0, 0.0006, change=-0.01)
    assert torch.allclose(resumed.param.detach(), running.param.detach())
    assert not torch.allclose(forgetful.param.detach(), running.param.detach(), atol=1e-3)  # the buffer mattered

    other_model = OuterOptimizer(NESTEROV, [torch.zeros(3)])
    with pytest.raises(ValueError, match="does not match this model"):
        other_model.load_state_dict(checkpoint["outer"])


def test_a_state_download_makes_the_donors_weights_the_anchor_and_restarts_the_buffer(make_peer):
    """Reset, not the donor's buffer: that buffer is the progress from the donor's anchor, which is not ours, and
    serving it would add two copies of the parameters to every download; at b = 0.5 a buffer fades in ~3 rounds."""
    donor, peer = make_peer(FAST), make_peer(FAST, NESTEROV)
    averaged_round(peer, 0, 0.0002, change=-0.01)
    r = peer.start_and_trigger(1)  # in flight while the download replaces our weights
    assert peer.outer.buffer[0].abs().sum() > 0
    donated = float(peer.param[0]) - 0.02
    with torch.no_grad():
        donor.param.fill_(donated)
    metadata, tensors, _ = donor.state_transfer.serve()
    peer.hivemind.load_state_from_peers = lambda timeout: (metadata, tensors)
    assert peer.state_transfer.load(peer.hivemind, timeout=5.0, accept=None) is not None
    assert torch.equal(peer.outer.anchor[0], torch.full((64,), donated)) and peer.outer.buffer[0].abs().sum() == 0
    assert r.stale
    peer.hivemind.finish(1, [torch.full((64,), 0.5)])  # the round whose snapshot predates the download
    peer.scheduler.tick()
    assert peer.state_of(1) == "DISCARDED"
    assert torch.equal(peer.outer.anchor[0], torch.full((64,), donated)) and peer.outer.steps == 1  # left alone

    # the next round's outer step starts from the donor's weights with a fresh buffer (u = d)
    snapshot, mean = donated - 0.03, donated - 0.025
    update = [torch.full((64,), mean - snapshot)]
    peer.outer.step_(update, [torch.full((64,), mean)])
    d = donated - mean
    expected = donated - 0.8 * (d + 0.5 * d)
    assert torch.allclose(peer.outer.anchor[0], torch.full((64,), expected), atol=1e-6)
    assert torch.allclose(update[0], torch.full((64,), expected - snapshot), atol=1e-6)


def test_outer_settings_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"outer_momentum must be in \[0, 1\)"):
        OuterSettings(momentum=1.0)
    with pytest.raises(ValueError, match="outer_lr must be > 0"):
        OuterSettings(lr=0.0)
    assert not OuterSettings().enabled and OuterSettings(lr=0.7).enabled
