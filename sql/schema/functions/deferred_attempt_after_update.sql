-- deferred_attempt_after_update: the AFTER UPDATE trigger of
-- deferred_message that records, in deferred_attempt, every change of a
-- message's state: parked, rejected, or replayed (back to pending). The row
-- keeps the lineage of its first history row; failing that, as for an
-- insert, that of its origin_id.

CREATE OR REPLACE FUNCTION deferred_attempt_after_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferred_attempt (lineage_id, message_id, event, attempt, reason, error_class, error_message,
                                  target_topic, next_run_at)
    SELECT coalesce((SELECT a.lineage_id FROM deferred_attempt a
                     WHERE a.message_id = n.id ORDER BY a.message_id, a.id LIMIT 1),
                    CASE WHEN n.origin_id IS NOT NULL THEN
                        (SELECT a.lineage_id FROM deferred_attempt a
                         WHERE a.message_id = n.origin_id ORDER BY a.message_id, a.id LIMIT 1)
                    END, n.origin_id, n.id),
           n.id,
           CASE n.state WHEN 'pending' THEN 'replayed' ELSE n.state END,
           n.attempt, n.reason, n.error_class, n.error_message, n.target_topic, n.next_run_at
    FROM old_rows p
    JOIN new_rows n ON n.id = p.id
    WHERE p.state IS DISTINCT FROM n.state
    ORDER BY n.id;
    RETURN NULL;
END
$$;
