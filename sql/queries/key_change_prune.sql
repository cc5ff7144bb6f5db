-- Delete up to $2 (int) rows of the blocked-key feed (deferred_key_change)
-- older than $1 (interval), and return how many went. The highest
-- transaction id deleted goes to deferred_key_change_pruned: a reader whose
-- cursor is not above it may have missed a change, and loads its set again
-- (key_changes.sql). Maintenance repeats it while it deletes a full batch.
WITH old AS (
    SELECT c.ctid
    FROM deferred_key_change c
    WHERE c.changed_at < now() - $1::interval
    LIMIT $2
), gone AS (
    DELETE FROM deferred_key_change c
    USING old
    WHERE c.ctid = old.ctid
    RETURNING c.xid
), mark AS (
    INSERT INTO deferred_key_change_pruned (only_row, below)
    SELECT true, max(gone.xid) FROM gone HAVING count(*) > 0
    ON CONFLICT (only_row) DO UPDATE SET below = greatest(deferred_key_change_pruned.below, excluded.below)
)
SELECT count(*) AS pruned FROM gone
