-- Delete up to $2 (int) rows of the attempt history older than $1
-- (interval, HISTORY_RETENTION), oldest first, and return how many went.
-- Maintenance repeats it while it deletes a full batch, so one run never
-- holds many row locks or writes a huge transaction. History rows arrive in
-- id order and time order alike, so the primary key walks the oldest first
-- and stops after the batch.
WITH old AS (
    SELECT id
    FROM deferred_attempt
    WHERE recorded_at < now() - $1::interval
    ORDER BY id
    LIMIT $2
), gone AS (
    DELETE FROM deferred_attempt a
    USING old
    WHERE a.id = old.id
    RETURNING 1
)
SELECT count(*) AS pruned FROM gone
