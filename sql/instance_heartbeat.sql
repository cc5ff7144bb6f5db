-- This process ($1, its River client id) is alive.
INSERT INTO scheduler_instance (id) VALUES ($1)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()
