"""The django.tasks comparison (``bench/compare.py --tasks``, #37): one task module, run
on k2b_workflows' backend and on django-tasks-db's, each with settings of its own."""
