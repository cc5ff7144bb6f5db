-- This process ($1, its River client id) is alive. With the beat, the
-- deferred_message id and seq sequences move past $2 and $3, the highest
-- this process has seen, if a database that went back in time left them
-- behind (migration 0005); the sequences' values come back, for the process
-- to remember.
WITH beat AS (
    INSERT INTO scheduler_instance (id) VALUES ($1)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()
)
SELECT id_high, seq_high FROM deferred_sequences_advance($2, $3)
