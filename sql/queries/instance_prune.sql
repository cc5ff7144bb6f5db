-- Forget processes that have not been heard of for an hour.
DELETE FROM scheduler_instance WHERE heartbeat_at < now() - interval '1 hour'
