"""Pickling code by value for the ranks, so that a rank's traceback shows the cell's source.

A function defined in a notebook cell cannot be pickled by reference: cloudpickle ships its code
by value. Two things must travel with it for a remote traceback to show the cell's lines:

* each code object's filename (``/tmp/ipykernel_123/456.py``). cloudpickle 3.1.3 replaces it with
  ``"<dynamic-code>"`` (earlier releases kept it), so :class:`CodePickler` carries it beside
  cloudpickle's own reduction and puts it back when the rank unpickles the code;
* the cell's source, which lives only in the kernel's ``linecache``: :func:`dumps` returns it
  for every file that the payload's code comes from and that exists nowhere on disk, and
  :func:`install_sources` puts it into the rank's ``linecache``.

Example::

    payload = dumps((fn, args, kwargs), parts=[("fn", fn)], refusal="cannot send {part}")
    # in the rank:
    install_sources(payload.sources); fn, args, kwargs = cloudpickle.loads(payload.data)

Imports only cloudpickle and the standard library; every other dtlib module may import it.
"""

from __future__ import annotations

import io
import linecache
import os
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import cloudpickle


def _code_with_filename(rebuild: Callable[..., types.CodeType], args: tuple[Any, ...],
                        filename: str) -> types.CodeType:
    """Rebuild a code object from cloudpickle's reduction and give it back its own filename."""
    code = rebuild(*args)
    return code if code.co_filename == filename else code.replace(co_filename=filename)


class CodePickler(cloudpickle.Pickler):
    """cloudpickle's pickler that keeps every shipped code object's filename, and notes those files.

    Example: ``CodePickler(buffer).dump(fn)``; ``pickler.filenames`` then holds ``fn``'s file.
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.filenames: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:
            reduce = self.dispatch_table.get(types.CodeType)
            if reduce is not None:  # cloudpickle's own code reducer, whatever it does with co_filename
                self.filenames.add(obj.co_filename)
                rebuild, args = reduce(obj)[:2]
                return _code_with_filename, (rebuild, args, obj.co_filename)
        return super().reducer_override(obj)


class CannotSend(TypeError):
    """A value :func:`dumps` cannot pickle; ``reason`` says why in the learner's terms (the global a function
    uses, say), without the caller's preamble. Example: ``except CannotSend as err: print(err.reason)``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Payload(NamedTuple):
    """Pickled bytes, and the source lines of the in-memory files (notebook cells) their code comes from."""

    data: bytes
    sources: dict[str, list[str]]


def memory_only_sources(filenames: set[str]) -> dict[str, list[str]]:
    """The ``linecache`` lines of those files that exist only in memory, as a notebook cell's do.

    Example: ``memory_only_sources({"/tmp/ipykernel_1/2.py"})`` -> ``{"/tmp/ipykernel_1/2.py": ["def f(): ..."]}``.
    """
    sources = {}
    for filename in filenames:
        entry = linecache.cache.get(filename)
        if entry is not None and len(entry) == 4 and entry[1] is None and not os.path.exists(filename):
            sources[filename] = list(entry[2])
    return sources


def dumps(value: Any, *, parts: Sequence[tuple[str, Any]], refusal: str) -> Payload:
    """Pickle ``value`` by value with :class:`CodePickler`, or raise :class:`CannotSend` (a ``TypeError``) naming
    the part that cannot go.

    ``parts`` are ``(name, part)`` pairs that make up ``value``; ``refusal`` starts the error message,
    with ``{part}`` where the culprit's name goes.
    Example: ``dumps((fn, (), {}), parts=[("fn", fn)], refusal="cannot send {part} to the ranks")``.
    """
    buffer = io.BytesIO()
    pickler = CodePickler(buffer)
    try:
        pickler.dump(value)
    except Exception as exc:  # noqa: BLE001 - re-raised with the culprit named
        found = next(((name, part) for name, part in parts if not picklable(part)), None)
        culprit = f"{found[0]} ({type(found[1]).__name__})" if found else "a value"
        globals_ = unpicklable_globals(found[1]) if found and callable(found[1]) else []
        why = (f"it uses the global {', '.join(globals_)}, which cannot be pickled: pass it as an argument, or "
               f"create it inside the function" if globals_ else "it cannot be pickled")
        raise CannotSend(f"{refusal.format(part=culprit)}: {why}: {exc}", f"{why}: {exc}") from exc
    return Payload(buffer.getvalue(), memory_only_sources(pickler.filenames))


def unpicklable_globals(fn: Any) -> list[str]:
    """The globals that ``fn`` (and the functions and code nested in it) reads which cannot be pickled, each as
    ``name (type)``. Example: a function that uses a module-level lock gives ``["lock (lock)"]``."""
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    names: set[str] = set()
    todo = [code] if code is not None else []
    while todo:
        current = todo.pop()
        names.update(current.co_names)
        todo.extend(const for const in current.co_consts if hasattr(const, "co_names"))
    return [f"{name} ({type(scope[name]).__name__})" for name in sorted(names)
            if name in scope and not picklable(scope[name])]


def picklable(value: Any) -> bool:
    """Whether cloudpickle can pickle ``value``. Example: ``picklable(lambda: 1)`` is True; a lock is not."""
    try:
        CodePickler(io.BytesIO()).dump(value)
    except Exception:  # noqa: BLE001
        return False
    return True


def install_sources(sources: dict[str, list[str]]) -> None:
    """Put in-memory source lines into this process's ``linecache``, so tracebacks show them."""
    for filename, lines in sources.items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
