-- deferred_key_change_reset: a TRUNCATE of deferred_message or
-- deferred_inflight frees keys without a row to name them. Every reader of
-- the feed whose cursor is not above this transaction must load its
-- blocked-key set again: deferred_key_change_pruned says so (key_changes.sql).
CREATE OR REPLACE FUNCTION deferred_key_change_reset() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferred_key_change_pruned (only_row, below) VALUES (true, pg_current_xact_id())
    ON CONFLICT (only_row) DO UPDATE SET below = greatest(deferred_key_change_pruned.below, excluded.below);
    RETURN NULL;
END
$$;
