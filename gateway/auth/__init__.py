"""Who a client is: authentication (bearer tokens, OAuth 2.1 JWTs, the unix socket's peer) and
the :class:`~gateway.auth.principal.Principal` a connection carries."""
