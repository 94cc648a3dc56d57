import logging

import pytest

from contracts.metrics import THIRD_PARTY_LOGGERS, setup_logging

SIGNED = 'HTTP Request: POST http://127.0.0.1:4711/mcp?signature=per-rollout-secret "HTTP/1.1 200 OK"'


@pytest.fixture
def library_levels_restored():
    levels = {name: logging.getLogger(name).level for name in THIRD_PARTY_LOGGERS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("library", ["httpx", "httpx2"])  # httpx2: the client of each MCP tool call
def test_http_client_info_lines_reach_the_process_log_only_at_debug(library, capsys, library_levels_restored):
    setup_logging("orchestrator", "info")
    logging.getLogger(library).info(SIGNED)
    logging.getLogger(library).warning("connection pool full")
    logging.getLogger("orchestrator").info("step 1")
    err = capsys.readouterr().err
    assert "signature=per-rollout-secret" not in err
    assert "connection pool full" in err and "step 1" in err

    setup_logging("orchestrator", "debug")
    logging.getLogger(library).info(SIGNED)
    assert "signature=per-rollout-secret" in capsys.readouterr().err
