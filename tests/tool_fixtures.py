"""Tools that misbehave, for tests/rollout/test_tools.py and test_agent_loop.py (loaded by path in tool workers)."""

import os
import sys
import time


def echo(text: str) -> str:
    """Return the text.

    Args:
        text: any text
    """
    return text


def raiser(text: str) -> str:
    """Raise.

    Args:
        text: any text
    """
    raise RuntimeError(f"tool failed on {text}")


def hang(text: str) -> str:
    """Sleep forever.

    Args:
        text: any text
    """
    time.sleep(3600)
    return text


def crash(text: str) -> str:
    """Kill the worker process.

    Args:
        text: any text
    """
    os._exit(3)


def flood(text: str) -> str:
    """Print and return a lot.

    Args:
        text: any text
    """
    for _ in range(10000):
        print("spam" * 100)
        sys.stderr.write("spam\n")
    return "y" * 1_000_000


def memory_bomb(text: str) -> str:
    """Allocate 8 GiB.

    Args:
        text: any text
    """
    x = bytearray(8 << 30)
    return str(len(x))


def not_text(text: str) -> str:
    """Return something that is not JSON.

    Args:
        text: any text
    """
    return object()


def no_return(text: str) -> str:
    """Forget to return (None).

    Args:
        text: any text
    """
    text.upper()


def read_env(name: str) -> str:
    """An environment variable of the tool worker.

    Args:
        name: variable name
    """
    return str(os.environ.get(name))
