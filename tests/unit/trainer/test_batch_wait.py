"""The trainer waits for a batch as long as the orchestrator shows it is alive (its progress file changes), and
times out batch_timeout_s after its last sign of life."""

import threading
import time

import pytest

from contracts.progress import Progress
from contracts.run_dir import rollouts_dir
from trainer.config import TrainerConfig
from trainer.train import train


def config(output_dir, model_path) -> TrainerConfig:
    return TrainerConfig(output_dir=output_dir, model={"name": model_path}, max_steps=2, batch_timeout_s=1.0)


def test_a_slow_orchestrator_that_shows_it_is_alive_is_waited_for(tmp_path, write_batches, tiny_model_path):
    orchestrator = Progress(tmp_path, "orchestrator")
    sampling = orchestrator.begin("sampling step 1", total=8, unit="groups")
    stop = threading.Event()

    def slow_orchestrator():  # 3 s of rollouts (3 x batch_timeout_s), alive all along, then the batches
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            orchestrator.write()
            time.sleep(0.2)
        write_batches(tmp_path, steps=2)
        orchestrator.end(sampling)
        stop.wait()

    thread = threading.Thread(target=slow_orchestrator, daemon=True)
    thread.start()
    try:
        train(config(tmp_path, tiny_model_path))
    finally:
        stop.set()
    assert rollouts_dir(tmp_path, 1).exists()
    assert (tmp_path / "weights" / "step_2" / "STABLE").exists()  # both steps trained


def test_a_silent_orchestrator_times_the_trainer_out_after_its_last_sign_of_life(tmp_path, tiny_model_path):
    orchestrator = Progress(tmp_path, "orchestrator")
    signs = []  # when it wrote its progress

    def alive_then_silent():
        for _ in range(10):  # 2 s of signs of life, then silence
            orchestrator.write()
            signs.append(time.monotonic())
            time.sleep(0.2)

    thread = threading.Thread(target=alive_then_silent, daemon=True)
    thread.start()
    with pytest.raises(TimeoutError, match="with no sign of life from it waiting for the orchestrator's batch"):
        train(config(tmp_path, tiny_model_path))
    assert len(signs) == 10 and time.monotonic() - signs[-1] >= 1.0  # batch_timeout_s after the last one
