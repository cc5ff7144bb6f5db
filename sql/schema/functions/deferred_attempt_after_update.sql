-- deferred_attempt_after_update: the AFTER UPDATE trigger of
-- deferred_message that records, in deferred_attempt, every change of a
-- message's state (parked, rejected, or replayed: back to pending), and a
-- pending message made due earlier (expedited: expedite_*.sql, or any
-- UPDATE that lowers next_run_at). The row keeps the lineage of its first
-- history row; failing that, as for an insert, that of its origin_id.
--
-- actor says who: NULL inside dispatch's finalize (its parks; it sets
-- scheduler.finalizing), else the transaction's scheduler.actor
-- (operate.SetActor), else session_user, which is not changed by SECURITY
-- DEFINER: an operator with psql is named by the role they logged in as.
--
-- A message stored pending (not gated) has no history row until something
-- else happens to it (deferred_attempt_after_insert.sql, migration 0012):
-- its deferral is written here first, as a 'deferred' row made from the
-- row as it was before this statement, recorded at its created_at, in the
-- lineage the insert would have given it. Any update does it, not only
-- those recorded as events below, so that the deferral is the row as
-- stored, not as an operator edited it since.

CREATE OR REPLACE FUNCTION deferred_attempt_after_update() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    actor text := CASE WHEN nullif(current_setting('scheduler.finalizing', true), '') IS NULL
                       THEN coalesce(nullif(current_setting('scheduler.actor', true), ''), session_user::text)
                  END;
BEGIN
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
                     WHERE a.message_id = n.id ORDER BY a.message_id, a.id LIMIT 1),
                    CASE WHEN n.origin_id IS NOT NULL THEN deferred_lineage(n.origin_id) ELSE n.id END),
           n.id,
           CASE WHEN p.state IS NOT DISTINCT FROM n.state THEN 'expedited'
                WHEN n.state = 'pending' THEN 'replayed'
                ELSE n.state
           END,
           n.attempt, n.reason, n.error_class, n.error_message, n.target_topic, n.next_run_at, actor
    FROM old_rows p
    JOIN new_rows n ON n.id = p.id
    WHERE p.state IS DISTINCT FROM n.state
       OR (p.state = 'pending' AND n.state = 'pending' AND n.next_run_at < p.next_run_at)
    ORDER BY n.id;
    RETURN NULL;
END
$$;
