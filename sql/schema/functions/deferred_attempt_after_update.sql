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

CREATE OR REPLACE FUNCTION deferred_attempt_after_update() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    actor text := CASE WHEN nullif(current_setting('scheduler.finalizing', true), '') IS NULL
                       THEN coalesce(nullif(current_setting('scheduler.actor', true), ''), session_user::text)
                  END;
BEGIN
    INSERT INTO deferred_attempt (lineage_id, message_id, event, attempt, reason, error_class, error_message,
                                  target_topic, next_run_at, actor)
    SELECT coalesce((SELECT a.lineage_id FROM deferred_attempt a
                     WHERE a.message_id = n.id ORDER BY a.message_id, a.id LIMIT 1),
                    CASE WHEN n.origin_id IS NOT NULL THEN
                        (SELECT a.lineage_id FROM deferred_attempt a
                         WHERE a.message_id = n.origin_id ORDER BY a.message_id, a.id LIMIT 1)
                    END, n.origin_id, n.id),
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
