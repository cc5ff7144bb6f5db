-- deferred_attempt_after_delete: the AFTER DELETE trigger of
-- deferred_message that records 'cancelled' in deferred_attempt for every
-- message deleted by anyone but dispatch's finalize (cancel_id.sql, an
-- operator's DELETE), with who (as deferred_attempt_after_update.sql says)
-- and the state, reason and due time the message had. The finalize deletes
-- what it published and records 'published' itself (dispatch_delete.sql);
-- it sets scheduler.finalizing first, and the trigger's WHEN test
-- (triggers/deferred_message.sql) skips this function then; the test here
-- repeats it for a direct call.
--
-- A message stored pending (not gated) has no history row until something
-- else happens to it (deferred_attempt_after_insert.sql, migration 0012):
-- its deferral is written here first, as a 'deferred' row made from the
-- row as it was before the delete, recorded at its created_at, in the
-- lineage the insert would have given it.

CREATE OR REPLACE FUNCTION deferred_attempt_after_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF nullif(current_setting('scheduler.finalizing', true), '') IS NOT NULL THEN
        RETURN NULL;
    END IF;
    INSERT INTO deferred_attempt (lineage_id, message_id, event, attempt, reason, error_class, error_message,
                                  target_topic, next_run_at, recorded_at)
    SELECT CASE WHEN o.origin_id IS NOT NULL THEN deferred_lineage(o.origin_id) ELSE o.id END,
           o.id, 'deferred', o.attempt, o.reason, o.error_class, o.error_message, o.target_topic, o.next_run_at,
           o.created_at
    FROM old_rows o
    WHERE o.state = 'pending' AND NOT o.gated
      AND NOT EXISTS (SELECT FROM deferred_attempt a WHERE a.message_id = o.id)
    ORDER BY o.id;
    INSERT INTO deferred_attempt (lineage_id, message_id, event, attempt, reason, error_class, error_message,
                                  target_topic, next_run_at, actor)
    SELECT coalesce((SELECT a.lineage_id FROM deferred_attempt a
                     WHERE a.message_id = o.id ORDER BY a.message_id, a.id LIMIT 1),
                    CASE WHEN o.origin_id IS NOT NULL THEN deferred_lineage(o.origin_id) ELSE o.id END),
           o.id, 'cancelled', o.attempt, o.reason, o.error_class, o.error_message, o.target_topic, o.next_run_at,
           coalesce(nullif(current_setting('scheduler.actor', true), ''), session_user::text)
    FROM old_rows o
    ORDER BY o.id;
    RETURN NULL;
END
$$;
