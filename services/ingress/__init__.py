"""Ingress: the OpenAI-compatible HTTP front door. It validates and tokenizes client requests,
hands them to the cluster through a :class:`~services.ingress.gateway.Gateway`, and streams the
answers back."""
