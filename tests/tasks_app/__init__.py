"""The django.tasks tasks the suite enqueues (``tasks``), and a module as a bad deploy
leaves it on one worker (``fragile``) (#37). Imported by path by the workers, as a
project's task modules are."""
