"""The observer: what each rank holds and sends. `trace` records a step from the runtime's
events, `accounting` counts bytes held and the theory of bytes sent, `report` renders a traced
step as one HTML page, `charts` draws with matplotlib."""
