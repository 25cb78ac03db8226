"""I/O shells: the only code touching sockets.  Each maps its library's exceptions to
:class:`~gateway.errors.TransportClosed` / :class:`~gateway.errors.MessageTooLarge`."""
