"""A request body, from its bytes to what the engine takes: validated, bounded and read.

    parse.py     bodies -> SamplingParams and prompts, 400s naming the field (the route's
                 entry: the rules that span several fields)
    protocol.py  one served model's request models: validation, and /openapi.json's schemas
    generation_models.py  the generation routes' bodies (the sampling fields, each route's)
    parts.py     what the bodies are built from: lax scalars, ranges, Message, Bounds
    constraints.py  a request's structured-output constraint (response_format, guided_*)
    limits.py    a request's size limits, checked before the work they bound
    nesting.py   how deep a JSON text nests, found without parsing it
    invalid.py   a request model's validation errors as one OpenAI error object
"""
