"""One recipe per swarm, and each mistake named on the box that made it: real VISSL boxes (paced ``run_trainer.py``
processes on 127.0.0.1) around one first box that trains for the whole module.

- the first box writes its join line to ``join.txt`` and prints it again as the last start-up line;
- a box started from that line (its placeholders filled in) averages under the swarm's budget;
- a box whose recipe differs refuses to start, naming each differing value and the one to pass;
- a box with another swarm secret is told so on itself, within ``--alone_warning_after``;
- a box killed and restarted with the same identity replaces its earlier record: the count and the LR factor stay
  those of two boxes;
- a Ctrl-C to a box's process group ends it with one INFO line, no ERROR or WARN line, and out of the count at once.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest

from tests.paced_trainer import paced_peer
from vissl_swarm import swarm
from vissl_swarm.local_swarm import LocalPeer, fixed_address, stop_all, wait_until

RUN = ["--run_id", "recipetest", "--swarm_lr", "sqrt", "--min_matchmaking_time", "2"]
# the swarm's recipe: 10 iterations of batch 16 an epoch, epochs enough that the swarm never ends in the test
RECIPE = ["config.DATA.TRAIN.DATA_LIMIT=160", "config.OPTIMIZER.num_epochs=1000"]
QUIET = ["config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=-1", "config.CHECKPOINT.CHECKPOINT_FREQUENCY=1000"]
BUDGET = 160 * 1000
SQRT2 = round(2**0.5, 4)


class Swarm:
    """The first box, started once for the module, and the boxes each test adds (stopped at the module's end)."""

    def __init__(self, out: Path, data: Path) -> None:
        self.out, self.data, self.boxes = out, data, []
        self.first = paced_peer("first", out)
        flags, _ = fixed_address(self.first)
        self.first.start(data, [], [*RUN, *flags], [*RECIPE, *QUIET])
        self.boxes.append(self.first)
        self.first.join_addresses()

    def join_words(self, box: LocalPeer) -> list[str]:
        """The first box's join.txt, its placeholders filled in for ``box`` (on the loopback: port 0)."""
        line = (self.first.checkpoint_dir / swarm.JOIN_FILE).read_text().strip()
        identity = box.out_dir / f"{box.name}.key"
        values = [str(self.data), "0", str(identity), str(box.checkpoint_dir)]
        for placeholder, value in zip(swarm.PLACEHOLDERS, values, strict=True):
            line = line.replace(placeholder, value)
        words = shlex.split(line.replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/"))
        assert words[1] == "run_trainer.py", words
        return words[2:]

    def start(self, name: str, change=lambda words: words, extra: list[str] = ()) -> LocalPeer:
        box = paced_peer(name, self.out)
        self.boxes.append(box)
        box.out_dir.mkdir(parents=True, exist_ok=True)
        box.start(self.data, [], [*change(self.join_words(box)), *extra], QUIET)
        return box


def other_recipe(words: list[str]) -> list[str]:
    return [word for word in words if word != "config.OPTIMIZER.num_epochs=1000"] + ["--swarm_lr", "box"]


@pytest.fixture(scope="module")
def swarm_of_one(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The first box, then, once its join.txt is written, three boxes at once (their start-ups overlap): one of another
    recipe, one as its join line says, one with another secret."""
    out = tmp_path_factory.mktemp("one_recipe")
    running = Swarm(out, digits_dir)
    try:
        wait_until(lambda: (running.first.checkpoint_dir / swarm.JOIN_FILE).exists(), 240, running.first.exit_message)
        running.start("other_recipe", other_recipe)
        running.start("joiner")
        (out / "other.key").write_text("not the swarm's secret\n")
        running.start(
            "other_secret", extra=["--swarm_secret_file", str(out / "other.key"), "--alone_warning_after", "30"]
        )
        yield running
    finally:
        stop_all(running.boxes)


def named(running: Swarm, name: str) -> LocalPeer:
    return next(box for box in running.boxes if box.name == name)


def log_lines(box: LocalPeer) -> list[str]:
    return box.log_text().splitlines()


pytestmark = [pytest.mark.xdist_group("swarm_scenarios"), pytest.mark.timeout(600)]  # the first one starts the swarm


def test_the_join_line_is_in_join_txt_and_last_at_start(swarm_of_one: Swarm) -> None:
    first = swarm_of_one.first
    wait_until(lambda: first.progress(), 240, lambda: f"a progress line of the first box: {first.exit_message()}")
    line = (first.checkpoint_dir / swarm.JOIN_FILE).read_text().strip()
    assert all(placeholder in line for placeholder in swarm.PLACEHOLDERS[1:]), line
    assert all(override in line for override in RECIPE) and "--run_id recipetest" in line, line
    lines = log_lines(first)
    printed = [index for index, text in enumerate(lines) if text.strip() == line]
    assert len(printed) == 2, printed
    # the second one comes after VISSL's start-up output (its config dump and model printout), before the first step
    first_step = next(index for index, text in enumerate(lines) if re.search(r"\bstep \d+ \| loss", text))
    start_up = [index for index, text in enumerate(lines[:first_step]) if "To join this swarm" not in text]
    assert printed[1] >= start_up[-1] - 1 and printed[1] > first_step - 5, lines[printed[1] - 3 : first_step + 1]


def test_a_box_of_another_recipe_refuses_naming_each_value_to_pass(swarm_of_one: Swarm) -> None:
    refused = named(swarm_of_one, "other_recipe")
    wait_until(lambda: not refused.is_running(), 180, "the box of another recipe ending")
    log = refused.log_text()
    assert refused.process.returncode == 2, log[-3000:]
    assert "pass config.OPTIMIZER.num_epochs=1000" in log and "pass --swarm_lr sqrt (this box has box)" in log, log
    assert "Traceback" not in log and not refused.checkpoint_dir.exists()


def test_a_box_from_the_join_line_averages_under_the_swarms_budget(swarm_of_one: Swarm) -> None:
    joiner = named(swarm_of_one, "joiner")
    joined = wait_until(
        lambda: re.search(r"Joined the swarm at its position: (\d+) samples of (\d+)", joiner.log_text()),
        240,
        lambda: f"the joiner's state download: {joiner.exit_message()}",
    )
    assert int(joined.group(2)) == BUDGET
    wait_until(
        lambda: joiner.applied_rounds(), 120, lambda: f"an averaging round of the joiner: {joiner.exit_message()}"
    )
    assert f"the swarm's budget is {BUDGET} samples" in joiner.log_text()


def test_a_box_with_another_secret_is_told_so_on_itself(swarm_of_one: Swarm) -> None:
    other = named(swarm_of_one, "other_secret")
    alone = wait_until(  # once, after --alone_warning_after: the cause it names is the secret, with the fix
        lambda: [text for text in log_lines(other) if "This box has averaged with nobody" in text],
        240,
        lambda: f"the alone warning of the box with another secret: {other.exit_message()}",
    )
    assert len(alone) == 1 and "Likely cause: no peer of this swarm accepts our secret" in alone[0], alone
    assert "without one" in alone[0] and "--swarm_secret_file" in alone[0], alone
    assert not other.applied_rounds()
    other.stop()


def test_a_restarted_box_replaces_its_record_and_a_ctrl_c_leaves_the_count_at_once(swarm_of_one: Swarm) -> None:
    first, box = swarm_of_one.first, named(swarm_of_one, "joiner")
    wait_until(lambda: box.is_running() and box.applied_rounds(), 240, "the joiner averaging")
    box.kill()  # a crash: its record stays in the DHT until it expires
    restarted_at = time.time()
    box.start(swarm_of_one.data, [], [*swarm_of_one.join_words(box)], QUIET)  # the same command, the same identity
    wait_until(
        lambda: box.applied_rounds(since=restarted_at), 240, lambda: f"the restart averaging: {box.exit_message()}"
    )
    seen_at = time.time()
    wait_until(lambda: [e for e in first.progress() if e["time"] > seen_at + 10], 120, "10 s more of the first box")
    after = [(e["boxes"], e["lr_factor"]) for p in (first, box) for e in p.progress() if e["time"] > restarted_at]
    assert after and all(boxes <= 2 for boxes, _ in after), after  # never the earlier life counted beside it
    assert (2, SQRT2) in after and all(factor <= SQRT2 for _, factor in after), after

    stopped_at = time.time()
    box.stop()  # Ctrl-C to its whole process group, as a terminal sends it
    assert box.process.returncode == 0, box.exit_message()
    tail = box.log_text()[box.log_text().rindex("step ") :]
    assert "the other boxes count it out now" in tail, tail
    noise = [text for text in tail.splitlines() if re.search(r"\b(ERROR|WARN|WARNING)\b|Traceback", text)]
    assert not noise, tail
    wait_until(
        lambda: [e for e in first.progress() if e["time"] > stopped_at + 1 and e["boxes"] == 1],
        30,
        "the first box counting one box",
    )
