"""`POST /v1/responses` (stateless), on the chat machinery.

    route.py     the route: a Responses request run as a chat request, answered or streamed
    translate.py its request as a chat completions body, and errors in its own field names
    events.py    the chat output as Responses events and the final Response object
"""
