"""The harness at a server we do not control (`sim replay --target URL`), a file each:

    wire.py      one exchange as its client saw it: status, headers, frames and their times
    answer.py    what an answer says, read alike from a unary body and a stream's frames
    target.py    the server under test and the deterministic requests the checks share
    checks.py    stream = unary, UTF-8 frames, stop strings, usage, bad input
    load.py      hang-ups free their slots (the server's gauge, or a queued request)
    pacing.py    slow readers do not pace other streams
    traces.py    a trace's client behaviour replayed there, and its checks
    outcome.py   pass, fail (with evidence) or unsupported; the report
    run.py       the checks in turn, into one report
    target_command.py  the flags `sim replay` adds for it
"""
