"""What turns logits into tokens.

    params.py         SamplingParams, their ranges and checks (ParamError)
    sampler.py        the batched sampler: one call per step for every row
    logits.py         the logits stages (penalties, bias, temperature, top-k/p, min-p)
    grammar.py        structured outputs: compiled constraints and their bitmasks
    schema_finite.py  whether a JSON schema has a finite instance
    seeds.py          the seeded hashes behind reproducible sampling (and the stub model)
"""
