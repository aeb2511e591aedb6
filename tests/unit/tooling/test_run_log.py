from tools.lib.runs import failure_line


def test_the_first_rank_error_wins_over_torchruns_summary():
    log = (
        "noise\n[rank3]: ValueError: bad value\n[rank0]: RuntimeError: connection closed\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\n"
    )
    assert failure_line(log) == "[rank3]: ValueError: bad value"


def test_without_an_error_line_the_last_line_that_is_not_a_banner():
    assert failure_line("a\nlast\n-----\n") == "last"
    assert failure_line("") == "(no output)"
    assert failure_line("x" * 500 + "Error", limit=10) == "x" * 10
