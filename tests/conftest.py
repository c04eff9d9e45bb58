import os

import pytest
import torch
from tiny_models import ARCHS


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker takes its share of torch's threads (OpenMP, also the C
    kernel's), and so do the processes it starts (OMP_NUM_THREADS: the Triton interpreter scripts).
    With every worker's threads on every core, each parallel region waits for a thread that is not
    running: on 2 cores, 2 workers of 2 threads ran test_hf_parity in 3x the CPU time of 2 workers
    of 1 thread, and 3-6x the wall time."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, torch.get_num_threads() // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random qwen3_moe with the demo model's tokenizer and chat template (read-only)."""
    from server_harness import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def server(tiny_model):
    """A live server on 127.0.0.1 over `tiny_model`, one per test module."""
    from server_harness import start_server

    srv = start_server(str(tiny_model))
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    """(architecture, folder) of a tiny random checkpoint of each architecture (tiny_models.py)."""
    from tiny_models import build_tiny

    folder = tmp_path_factory.mktemp(request.param)
    build_tiny(request.param, folder)
    return request.param, folder
