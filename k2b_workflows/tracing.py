"""OpenTelemetry spans for runs and steps, continued across workers, hosts and crashes.

The failure this guards against: a trace that ends where the request that
started a run ends. A run is executed later, by another process, maybe on
another host and days later, maybe by a second worker after the first died
mid-step; an engineer following the request's trace should still reach every
step that ran, and see that an attempt died and which one took over.

How: ``start_workflow_run`` stores the caller's W3C trace context
(``traceparent``, ``tracestate``) on the run (``WorkflowRun.trace_context``,
in the insert it makes anyway). Each claim of the run is one ``k2b.run``
span, a child of that context, whichever worker holds it; each step executed
(not replayed) is a ``k2b.step`` span under it, current while the action runs
so that spans of the action's own calls (HTTP clients, database drivers)
nest under it. The attempt stores its own span context on the run as it
starts; the next attempt links to it (``k2b.link`` = ``lease_expired`` after a
takeover, ``previous_attempt`` otherwise), so a trace shows the attempt that
died. Events: ``k2b.wait`` (a step parked), ``k2b.wake`` (on the caller's span:
runs re-queued), ``k2b.reconcile`` (its answer), ``k2b.run.<outcome>``, and a
``k2b.resolve`` span in the run's trace for an operator's decision.

Never in a span: the run's input or output, a step's input or output, an
effect key, a wait key, a principal, an evidence text or an actor's name. The
step span carries the step's keyed input hash (the ledger's), so a trace leads
to its ledger entry without revealing the input.

Cost: without ``opentelemetry-api`` (the ``k2b-workflows[otel]`` extra)
``ENABLED`` is False and every hook is one attribute check. With it but no
tracer provider set (no SDK: nothing would record), a claim makes no span and
writes no attempt's context: no round trip is added. With a provider whose
sampler drops the run, its span is non-recording and nothing is written either.
Only a recording run span costs one ``UPDATE`` of the run row per claim.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .exceptions import LeaseLost, RunCanceled, StepFailed, Suspend

if TYPE_CHECKING:
    from .actions import Action
    from .models import WorkflowRun

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed: every hook is a no-op
    ENABLED = False
else:
    ENABLED = True
    _PROPAGATOR = TraceContextTextMapPropagator()

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: The instrumentation scope of every span here.
TRACER_NAME = "k2b_workflows"
#: Outcomes of a run attempt that are errors to a tracing backend.
_ERROR_OUTCOMES = {"failed", "needs_attention"}

_ATTEMPT_SQL = """
UPDATE k2b_run SET trace_context = COALESCE(trace_context, '{}'::jsonb) || %s::jsonb
 WHERE id = %s AND generation = %s
"""


class Attempt(Protocol):
    """What a trace reads of the kernel's execution of one claim (``kernel/execute.py``)."""

    run_id: uuid.UUID
    run: WorkflowRun
    generation: int
    using: str
    outcome: str


#: The longest ``traceparent``/``tracestate`` kept: W3C caps tracestate at 512
#: characters; a 10 MB one was stored on the run and read at every claim (#35).
MAX_HEADER = 512
_HEADERS = ("traceparent", "tracestate")
#: Runs whose stored trace context was garbage, warned about once per process.
_warned: set[Any] = set()


def _headers(value: Any) -> dict[str, str]:
    """The W3C headers of ``value`` that are strings of at most ``MAX_HEADER`` characters."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k in _HEADERS if isinstance(v := value.get(k), str) and len(v) <= MAX_HEADER}


def stored_context(run_id: Any, stored: Any) -> dict[str, Any]:
    """A run's ``trace_context`` as the kernel wrote it, or what of it is sane.

    The runtime role can write the column: a string, a list or a huge header
    there raised at every claim (a traceback each time). What does not fit the
    kernel's shape is dropped, with one warning per run per process.
    """
    if stored is None:
        return {}
    clean: dict[str, Any] = _headers(stored)
    if isinstance(stored, dict):
        for key in ("first_attempt", "attempt"):
            if key in stored and (headers := _headers(stored[key])):
                clean[key] = headers
        generation = stored.get("attempt_generation")
        if isinstance(generation, int) and not isinstance(generation, bool):
            clean["attempt_generation"] = generation
    if clean != stored and run_id not in _warned:
        if len(_warned) > 10_000:
            _warned.clear()
        _warned.add(run_id)
        logger.warning(
            "run %s: its stored trace context is not one the kernel wrote; ignored what is not",
            run_id,
        )
    return clean


def _tracer() -> Any:
    return trace.get_tracer(TRACER_NAME)


def _provider_set() -> bool:
    """Whether a tracer provider was set (an SDK, in code or by ``OTEL_PYTHON_TRACER_PROVIDER``):
    without one, the API's tracers make only non-recording spans."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def _carrier(span_context: Any = None) -> dict[str, str]:
    """The W3C headers of ``span_context`` (default: the current span's)."""
    carrier: dict[str, str] = {}
    ctx = (
        None
        if span_context is None
        else trace.set_span_in_context(trace.NonRecordingSpan(span_context))
    )
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def capture() -> dict[str, str] | None:
    """The current trace context as stored on a new run, or None when nothing is traced."""
    if not ENABLED or not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier = _headers(_carrier())  # a tracestate past MAX_HEADER is not stored
    return carrier or None


def _span_context(headers: Any) -> Any:
    """The remote span context in stored W3C headers, or None."""
    if not isinstance(headers, dict) or "traceparent" not in headers:
        return None
    carrier = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
    span_context = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return span_context if span_context.is_valid else None


def _run_parent(run: WorkflowRun) -> Any:
    """The context a run's spans are children of: the starter's, else the first attempt's."""
    stored = stored_context(run.pk, run.trace_context)
    span_context = _span_context(stored) or _span_context(stored.get("first_attempt"))
    if span_context is None:
        return otel_context.Context()  # a new trace: not whatever this thread had current
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


def _attributes(execution: Attempt) -> dict[str, Any]:
    run = execution.run
    return {
        "k2b.run_id": str(execution.run_id),
        "k2b.workflow": run.workflow_name,
        "k2b.version": run.workflow_version,
        "k2b.app_id": run.app_id,
        "k2b.generation": execution.generation,
    }


class RunTrace:
    """The ``k2b.run`` span of one claim of a run, and the step span open under it."""

    def __init__(self, execution: Attempt) -> None:
        self.execution = execution
        run = execution.run
        stored = stored_context(run.pk, run.trace_context)
        links = []
        previous = _span_context(stored.get("attempt"))
        if previous is not None and stored.get("attempt_generation", 0) < execution.generation:
            died = run.consecutive_failures > 0 and run.error_message.startswith("lease expired")
            links.append(
                trace.Link(
                    previous,
                    {
                        "k2b.link": "lease_expired" if died else "previous_attempt",
                        "k2b.generation": int(stored.get("attempt_generation", 0)),
                    },
                )
            )
        self.span = _tracer().start_span(
            "k2b.run",
            context=_run_parent(run),
            kind=trace.SpanKind.CONSUMER,
            attributes=_attributes(execution),
            links=links,
        )
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        self.step_span: Any = None
        if self.span.is_recording():
            self._record_attempt(stored)

    def _record_attempt(self, stored: dict[str, Any]) -> None:
        """Store this attempt's span context on the run: the next attempt links to it."""
        from django.db import connections

        execution = self.execution
        headers = _carrier(self.span.get_span_context())
        if not headers:
            return
        update: dict[str, Any] = {
            "attempt": headers,
            "attempt_generation": execution.generation,
        }
        if _span_context(stored) is None and "first_attempt" not in stored:
            # Started outside any trace: later attempts join the trace of the first.
            update["first_attempt"] = headers
        try:
            with connections[execution.using].cursor() as cursor:
                cursor.execute(
                    _ATTEMPT_SQL, [json.dumps(update), execution.run_id, execution.generation]
                )
        except Exception:  # tracing must never stop a run
            logger.warning("run %s: could not store the trace context", execution.run_id)

    def event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        span = self.step_span if self.step_span is not None else self.span
        span.add_event(name, attributes or {})

    def waiting(self, seq: int, dependency: Any) -> None:
        self.event(
            "k2b.wait",
            {
                "k2b.step": seq,
                "k2b.wait.kind": str(getattr(dependency, "kind", "")),
                "k2b.wait.deadline": getattr(dependency, "deadline", None) is not None,
            },
        )

    def step(self, seq: int, action: Action, input_hash: str, execute: Callable[[], T]) -> T:
        """Run ``execute`` (a new step) inside its ``k2b.step`` span; note the outcome."""
        execution = self.execution
        attributes = {
            **_attributes(execution),
            "k2b.step": seq,
            "k2b.action": action.action_name(),
            "k2b.effect": str(action.effect),
            "k2b.input_hash": input_hash,
        }
        span = _tracer().start_span("k2b.step", attributes=attributes)
        self.step_span = span
        outcome = "succeeded"
        try:
            with trace.use_span(span, end_on_exit=False, record_exception=False):
                return execute()
        except StepFailed as exc:
            outcome = "failed"
            span.set_attribute("k2b.error_code", exc.code)
            raise
        except Suspend:
            # The run stopped at this step: retry, waiting, needs_attention, failed, ...
            outcome = execution.outcome
            raise
        except LeaseLost:
            outcome = "lease_lost"
            raise
        except RunCanceled:
            outcome = "canceled"
            raise
        except BaseException as exc:
            outcome = "error"
            span.set_attribute("k2b.error_type", type(exc).__name__)
            raise
        finally:
            span.set_attribute("k2b.outcome", outcome)
            if outcome in ("failed", "needs_attention", "error", "outcome_unknown"):
                span.set_status(trace.StatusCode.ERROR, outcome)
            self.step_span = None
            span.end()

    def end(self, outcome: str) -> None:
        """End the attempt's span with the run's outcome (``Attempt.outcome``)."""
        self.span.set_attribute("k2b.outcome", outcome)
        if outcome in _ERROR_OUTCOMES:
            error = getattr(self.execution.run, "error_code", "")
            self.span.set_status(trace.StatusCode.ERROR, outcome)
            if error:
                self.span.set_attribute("k2b.error_code", error)
        self.span.add_event(f"k2b.run.{outcome}")
        otel_context.detach(self._token)
        self.span.end()


def run_started(execution: Attempt) -> RunTrace | None:
    """The trace of a claim of a run, or None when tracing is off (the only cost then)."""
    if not ENABLED:
        return None
    if not _provider_set():
        # Nothing is configured to record: every span would be a non-recording one,
        # ended at once. Skip making it (about 5% of a no-op task's worker CPU), but
        # still look at the stored context, whose garbage is warned about either way.
        stored_context(execution.run.pk, execution.run.trace_context)
        return None
    try:
        run_trace = RunTrace(execution)
    except Exception:  # a broken SDK or stored context must never stop a run
        logger.warning("run %s: tracing failed to start", execution.run_id, exc_info=True)
        return None
    if not run_trace.span.is_recording():
        # The API without an SDK (or a sampler that drops this trace): no step spans,
        # so no cost per step beyond the check that there is no trace.
        run_trace.end(execution.outcome)
        return None
    return run_trace


def child_context(parent: dict[str, Any] | None) -> dict[str, Any] | None:
    """The trace context a child run stores: the creating step's span when one is
    recording, else the parent's own (children stay in the caller's trace either way)."""
    if ENABLED:
        current = capture()
        if current is not None:
            return current
    stored = stored_context(None, parent) if isinstance(parent, dict) else {}
    if not stored:
        return None
    kept = _headers(stored) or stored.get("first_attempt") or {}
    return kept or None


def woke(*, app_id: str, kind: str, woken: int) -> None:
    """A wake re-queued ``woken`` runs: an event on the caller's span (no key: it may identify)."""
    if not ENABLED:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(
            "k2b.wake", {"k2b.app_id": app_id, "k2b.wait.kind": kind, "k2b.woken": woken}
        )


def decided(run: WorkflowRun, decision: str, step: int | None) -> None:
    """An operator's decision on ``run`` (a resolution, a retry): a ``k2b.resolve`` span in
    the run's trace, linked to the caller's span. No evidence text, no actor in it."""
    if not ENABLED:
        return
    try:
        caller = trace.get_current_span().get_span_context()
        span = _tracer().start_span(
            "k2b.resolve",
            context=_run_parent(run),
            attributes={
                "k2b.run_id": str(run.pk),
                "k2b.workflow": run.workflow_name,
                "k2b.version": run.workflow_version,
                "k2b.step": -1 if step is None else step,
                "k2b.decision": decision,
            },
            links=[trace.Link(caller)] if caller.is_valid else [],
        )
        span.end()
    except Exception:  # tracing must never undo a committed decision
        logger.warning("run %s: could not trace the decision", run.pk, exc_info=True)
