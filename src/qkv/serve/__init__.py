"""The HTTP server: qkv's models behind a JSON API, and a page that shows their attention.

What is here: ``app.py`` (``create_app``: the routers of every family over one service, behind
the middleware), ``routes/`` (one FastAPI router per family: the page and service endpoints,
translate, generate, chat, embed, classify, attention), ``validation.py`` (a named check per
request against the limits and the model's window), ``service.py`` (what the routes share: the
models, limits, metrics, slots and batcher), ``jobs.py`` (the work, run on the model thread,
through ``qkv.bundle``'s job functions) and ``attention.py`` (every attention map of one input),
``models.py`` (the served models: a loaded bundle each, by name), ``schemas.py`` (the pydantic
request and response models, which the OpenAPI page at ``/docs`` shows), ``errors.py`` (one JSON
shape for every error), ``middleware.py`` (the body limit, metrics), ``http.py`` (uvicorn's
own 400 as JSON), ``batching.py`` (the dynamic batcher: requests that arrive within a few
milliseconds share one forward pass), ``metrics.py`` (Prometheus metrics), ``settings.py`` (the
limits) and ``static/`` (the page at ``/``: plain HTML, CSS and JavaScript, no build step).

The server is an adapter beside the command line (``qkv serve`` starts it): it loads models with
``bundle.load`` and calls the job functions the commands call (``bundle.translations``,
``bundle.generations`` and ``bundle.continued``, ``bundle.reply``, ``bundle.embeddings``; a
classifier's ``tasks.bert.predict_labels``; ``inspection`` for the maps) and never imports
``qkv.cli``. It reads no file a client names: models are loaded at start and named by the server.
"""
