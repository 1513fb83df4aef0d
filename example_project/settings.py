"""Settings for the example project.

Configuration comes from the environment (read with django-environ):

* ``DATABASE_URL`` (required): a PostgreSQL URL such as
  ``postgres://user:password@127.0.0.1:5432/k2b_workflows``. ``make demo`` and
  ``make test`` set it for you (an embedded PostgreSQL in ``.pgdata/``) unless it
  is already set.
* ``SECRET_KEY``: defaults to an insecure value that is only fit for local use.
* ``DEBUG``: defaults to True.
"""

from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env(
    DEBUG=(bool, True),
    SECRET_KEY=(str, "django-insecure-example-project-key-do-not-use-in-production"),
)

SECRET_KEY = env("SECRET_KEY")
DEBUG = env("DEBUG")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "pgtrigger",
    "k2b_workflows",
    "example_project.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example_project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "example_project.wsgi.application"


def _database_from_env(var: str = "DATABASE_URL") -> dict:
    if not env.str(var, default=""):
        raise ImproperlyConfigured(
            f"{var} is not set. Run the project through make ('make demo', "
            "'make test'), which starts an embedded PostgreSQL and sets it for you, "
            "or set DATABASE_URL to a PostgreSQL database, e.g. "
            "DATABASE_URL=postgres://postgres@127.0.0.1:5432/k2b_workflows"
        )
    db = env.db_url(var)
    # A unix-socket URL (postgresql://user@/name?host=/socket/dir) arrives with the
    # socket directory in OPTIONS; move it to HOST/PORT, where all of Django
    # (dbshell included) looks for it.
    options = db.setdefault("OPTIONS", {})
    if not db.get("HOST") and options.get("host"):
        db["HOST"] = options.pop("host")
    if not db.get("PORT") and options.get("port"):
        db["PORT"] = options.pop("port")
    # The kernel's hot statements run prepared (docs/performance.md): fine on a
    # direct connection and behind PgBouncer 1.21+ (max_prepared_statements);
    # None turns preparing off, Django's default, for older poolers.
    options.setdefault("prepare_threshold", 5)
    return db


DATABASES = {"default": _database_from_env()}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Settings of k2b_workflows; every key is optional and falls back to the app's
# default when left out.
K2B_WORKFLOWS: dict[str, object] = {}

# The demo and `make serve` connect as one role that owns the tables: the check
# that warns a role could rewrite the evidence (W003) would print at every
# migrate. In production connect web and workers as a runtime role instead
# (docs/security.md, "Two database roles") and do not silence it.
SILENCED_SYSTEM_CHECKS = ["k2b_workflows.W003"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
    },
    "loggers": {
        "k2b_workflows": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}
