-- deferred_key_change_after_insert: a message stored for a consumer group
-- may block its key for the group: tell the group's blocked-key sets
-- (deferred_key_change, read by key_changes.sql). Statement-level, over the
-- inserted rows: one INSERT per ingest batch, nothing for messages that
-- name no group or no key.
CREATE OR REPLACE FUNCTION deferred_key_change_after_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferred_key_change (group_id, business_key)
    SELECT DISTINCT n.group_id, n.business_key
    FROM new_rows n
    WHERE n.group_id IS NOT NULL AND n.business_key IS NOT NULL
      AND (n.state IN ('pending', 'rejected') OR (n.state = 'parked' AND n.park_holds_key));
    RETURN NULL;
END
$$;
