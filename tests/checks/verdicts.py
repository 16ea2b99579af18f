"""The one assertion every checker's bank makes: the verdict, and each fragment its message must hold."""


def assert_verdict(feedback, ok, fragments):
    """``feedback`` is right (``ok``) or wrong as expected, and its message holds every fragment."""
    assert feedback.ok is ok, feedback.message
    for fragment in fragments:
        assert fragment in feedback.message, feedback.message
