"""The API's routes: one FastAPI router per family of endpoints, each over its job.

What is here: ``info`` (the page, ``/health``, ``/metrics``, ``/v1/models``), ``translate``,
``generate`` (with its Server-Sent Events), ``chat``, ``embed``, ``classify``, ``attention``,
``audio`` (OpenAI's transcriptions, translations and speech), ``views`` (what the page's speech,
speech-out and chat views draw) and ``stream`` (speech heard as it is spoken, over a WebSocket).
Each route picks its model, validates the request (``validation.py``), runs its job
(``jobs.py``, through ``qkv.bundle``) on the model thread and answers in its schema
(``schemas.py``). ``app.create_app`` includes every router.

What is not here: the state they share (``service.py``), errors (``errors.py``).
"""
