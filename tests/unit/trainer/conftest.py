import pytest
from batches import random_samples, write_random_batches

from trainer.parallel import close_world, init_world


@pytest.fixture(name="random_samples")
def random_samples_fixture():
    return random_samples


@pytest.fixture
def write_batches():
    """:func:`batches.write_random_batches`."""
    return write_random_batches


@pytest.fixture
def world():
    """A one-rank process group (gloo on CPU) for the test, as the trainer makes when it runs alone."""
    world = init_world()
    yield world
    close_world()
