-- deferred_attempt_after_insert: the AFTER INSERT trigger of
-- deferred_message that writes the attempt history (deferred_attempt) for
-- messages stored parked, rejected or gated: each such row is an event of
-- its own from the start.
--
-- A message stored pending, not gated (a plain deferral, nearly every row
-- ingest writes) gets no history row here: its own row in deferred_message
-- records the deferral while nothing else happens to it (migration 0012).
-- The deferral reaches the history with the message's first other event:
-- the finalize that publishes it folds it into the 'published' row
-- (deferred_at, sql/queries/dispatch_delete.sql), and the update and delete
-- triggers write it as a 'deferred' row of its own, from the row as it was,
-- before their event (deferred_attempt_after_update.sql,
-- deferred_attempt_after_delete.sql). The view deferred_history unfolds it.
--
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
    SELECT CASE WHEN n.origin_id IS NOT NULL THEN deferred_lineage(n.origin_id) ELSE n.id END,
           n.id,
           CASE WHEN n.state <> 'pending' THEN n.state ELSE 'gated' END,
           n.attempt, n.reason, n.error_class, n.error_message, n.target_topic, n.next_run_at
    FROM new_rows n
    WHERE n.state <> 'pending' OR n.gated
    ORDER BY n.id;
    RETURN NULL;
END
$$;
