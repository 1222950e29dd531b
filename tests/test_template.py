"""Chat templates are untrusted code: rendered in a sandbox with bounds on time and output size."""

from __future__ import annotations

import threading
import time

import pytest

from turbospark_core.errors import TokenizerError
from turbospark_core.template import render_template

MESSAGES = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}


def test_a_plain_template_renders() -> None:
    assert render_template("{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}", MESSAGES) == "user: hi"


@pytest.mark.parametrize(
    ("template", "word"),
    [
        ("{{ 'a' * 10**12 }}", "character bound"),
        ("{{ [0] * 10**9 }}", "character bound"),
        ("{{ 2 ** 100000000 }}", "too large"),
        ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "more than"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
        ("{{ ''.__class__.__mro__ }}", "failed to render"),
        ("{% if %}", "TemplateSyntaxError"),
        ("{{ raise_exception('no system role') }}", "no system role"),
    ],
)
def test_hostile_templates_are_refused_by_name(template: str, word: str, names) -> None:
    with pytest.raises(TokenizerError) as err:
        render_template(template, MESSAGES, max_chars=1 << 20)
    names(err, word)


def test_a_template_that_loops_without_output_is_stopped_at_the_time_bound(names) -> None:
    start = time.perf_counter()
    with pytest.raises(TokenizerError) as err:
        render_template(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            MESSAGES,
            max_seconds=0.5,
        )
    assert time.perf_counter() - start < 5
    names(err, "0.5-second bound")


def test_a_timed_out_render_thread_is_stopped_and_nothing_else_sees_it() -> None:
    """The timeout exception goes to the render's own thread only; the thread ends."""
    before = threading.active_count()
    for seconds in (0.001, 0.01, 0.05):
        with pytest.raises(TokenizerError):
            render_template(
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                MESSAGES,
                max_seconds=seconds,
            )
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:  # Python code in the caller afterwards: nothing may land here
        pass
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
