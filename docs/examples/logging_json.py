"""docs/operations.md, "Logs": one JSON object per log line, with the run's fields."""

# --8<-- [start:json_logging]
import json
import logging


class JsonFormatter(logging.Formatter):
    FIELDS = ("event", "run_id", "workflow", "step", "generation", "effect_key",
              "action", "effect", "error_code", "answer")

    def format(self, record):
        data = {"time": self.formatTime(record), "level": record.levelname,
                "logger": record.name, "message": record.getMessage()}
        data.update({k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)})
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": JsonFormatter}},
    "handlers": {
        "stdout": {"class": "logging.StreamHandler", "formatter": "json",
                   "stream": "ext://sys.stdout"},
    },
    "loggers": {
        "k2b_workflows": {"handlers": ["stdout"], "level": "INFO", "propagate": False},
        # Set to WARNING to keep only doubt (outcome unknown, late results) and incidents.
        "k2b_workflows.events": {"level": "INFO"},
        "k2b_workflows.fleet": {"level": "INFO"},
    },
}
# --8<-- [end:json_logging]
