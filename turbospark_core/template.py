"""Chat templates: untrusted Jinja run in an immutable sandbox with bounds on time and output size.

A template comes from the install (or a GGUF file) and is code: the sandbox
stops it reaching Python internals, and :func:`render_template` bounds what is
left, so no template can hang the caller or exhaust memory:

- the output is built chunk by chunk and refused past ``max_chars``;
- ``*``/``**`` on strings, lists and numbers is refused when the result would
  pass the same bound (``"a" * 10**12``, ``2 ** 10**9``);
- a render that runs past ``max_seconds`` (a loop that outputs nothing) is
  refused at once, and its thread (one per render) is stopped by an exception
  raised in it;
- anything the template raises (``ZeroDivisionError``, a recursion limit...) is a
  :class:`~turbospark_core.errors.TokenizerError` naming the template.
"""

from __future__ import annotations

import ctypes
import operator
import threading
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.sandbox

from turbospark_core.errors import TokenizerError

MAX_RENDER_CHARS = 4 * 1024 * 1024
MAX_RENDER_SECONDS = 5.0
_REFIRE_SECONDS = 0.05
_STOP_ATTEMPTS = 200  # 10 s of resending before a render stuck in C code is left to finish alone


class _RenderTimeoutError(Exception):
    """Raised inside the rendering thread by the watchdog."""


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template refused the messages: {message}")


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, with ``*`` and ``**`` checked against the output bound."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.max_chars = max_chars
        self.globals["raise_exception"] = _raise_exception

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "**":
            if (
                isinstance(left, (int, float))
                and isinstance(right, (int, float))
                and abs(right) > 1024
                and abs(left) > 1
            ):
                raise jinja2.exceptions.SecurityError(f"{left!r:.20} ** {right!r:.20} is too large for a chat template")
            return operator.pow(left, right)
        sized = [
            (x, n)
            for x, n in ((left, right), (right, left))
            if isinstance(x, (str, list, tuple)) and isinstance(n, int)
        ]
        if sized and len(sized[0][0]) * max(sized[0][1], 0) > self.max_chars:
            raise jinja2.exceptions.SecurityError(
                f"repeating a sequence {sized[0][1]} times passes the {self.max_chars}-character bound"
            )
        return operator.mul(left, right)


def render_template(
    template: str,
    variables: dict[str, Any],
    *,
    max_chars: int = MAX_RENDER_CHARS,
    max_seconds: float = MAX_RENDER_SECONDS,
) -> str:
    """Render a chat template in the bounded sandbox.

    The render runs on a short-lived thread of its own: past ``max_seconds`` the
    caller gets a :class:`TokenizerError` at once, and the render thread is
    stopped by an exception raised in it (so nothing but that thread ever sees it).

    Raises:
        TokenizerError: The template does not compile, raises, or passes a bound (each named).
    """
    env = _BoundedSandbox(max_chars)
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["text"] = _render(env, template, variables, max_chars)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=work, name="chat-template", daemon=True)
    thread.start()
    thread.join(max_seconds)
    if thread.is_alive():
        _stop(thread)
        msg = f"the install's chat template ran past the {max_seconds:g}-second bound; fix or replace the chat template"
        raise TokenizerError(msg)
    error = box.get("error")
    if isinstance(error, TokenizerError):
        raise error
    if error is not None:  # the template is untrusted code: whatever it raised
        msg = f"the install's chat template failed to render ({type(error).__name__}: {str(error)[:300]})"
        raise TokenizerError(msg) from None
    return str(box["text"])


def _stop(thread: threading.Thread) -> None:
    """Raise :class:`_RenderTimeoutError` in ``thread`` until it ends (resent: one delivered in a
    weakref callback or ``__del__`` is swallowed); give up after ``_STOP_ATTEMPTS``."""
    for _ in range(_STOP_ATTEMPTS):
        if not thread.is_alive() or thread.ident is None:
            return
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_RenderTimeoutError))
        thread.join(_REFIRE_SECONDS)


def _render(env: _BoundedSandbox, template: str, variables: dict[str, Any], max_chars: int) -> str:
    pieces: list[str] = []
    size = 0
    for piece in env.from_string(template).generate(**variables):
        size += len(piece)
        if size > max_chars:
            msg = (
                f"the install's chat template rendered more than {max_chars} characters; "
                "fix or replace the chat template"
            )
            raise TokenizerError(msg)
        pieces.append(piece)
    return "".join(pieces)
