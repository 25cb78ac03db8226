"""Operations: metrics, admin HTTP, systemd integration, logging."""
