"""The HTTP server: qkv's models behind a JSON API, and a page that shows their attention.

What is here: ``app.py`` (the FastAPI application: endpoints, limits, errors; ``create_app``
takes loaded models and :class:`~qkv.serve.app.Settings`), ``schemas.py`` (the pydantic
request and response models, which the OpenAPI page at ``/docs`` shows), ``models.py`` (the
served models and the work each endpoint asks of them, run on the model thread),
``batching.py`` (the dynamic batcher: requests that arrive within a few milliseconds share one
forward pass), ``metrics.py`` (Prometheus metrics) and ``static/`` (the page at ``/``: plain
HTML, CSS and JavaScript, no build step).

The server is an adapter beside the command line (``qkv serve`` starts it): it calls the library
functions the commands call (``seq2seq.translate``, ``streaming.continuation_text``,
``chat.reply``, ``embedding.sentence_embeddings``, ``tasks.bert.predict_labels``,
``inspection``) and never imports ``qkv.cli``. It reads no file a client names: models are
loaded at start and named by the server.
"""
