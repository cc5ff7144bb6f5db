-- deferred_attempt_after_insert: the AFTER INSERT trigger of
-- deferred_message that writes the attempt history (deferred_attempt).
-- A re-deferral joins the lineage of the row it names in defer.id
-- (origin_id); if that row's history is gone (pruned), the lineage is named
-- after origin_id itself.

CREATE OR REPLACE FUNCTION deferred_attempt_after_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferred_attempt (lineage_id, message_id, event, attempt, reason, error_class, error_message,
                                  target_topic, next_run_at)
    -- Most rows are not re-deferrals: the lookup runs only for those that
    -- are, as one probe of deferred_attempt_message each.
    SELECT coalesce(CASE WHEN n.origin_id IS NOT NULL THEN
                        (SELECT a.lineage_id FROM deferred_attempt a
                         WHERE a.message_id = n.origin_id ORDER BY a.message_id, a.id LIMIT 1)
                    END, n.origin_id, n.id),
           n.id,
           CASE WHEN n.state <> 'pending' THEN n.state WHEN n.gated THEN 'gated' ELSE 'deferred' END,
           n.attempt, n.reason, n.error_class, n.error_message, n.target_topic, n.next_run_at
    FROM new_rows n
    ORDER BY n.id;
    RETURN NULL;
END
$$;
