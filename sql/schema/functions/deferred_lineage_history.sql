-- deferred_lineage_history(lineage): every event of a lineage
-- (deferred_lineage names a message's), as the view deferred_history has
-- them, read by index: the history rows of the lineage
-- (deferred_attempt_lineage); the deferrals folded into their 'published'
-- rows, unfolded; and the lineage's messages still pending with no history
-- row yet, each a 'deferred' event from its row (migration 0012). Those are
-- the lineage's first message, if still stored, and re-deferrals of its
-- messages, found by their origin (deferred_message_origin): a re-deferral
-- is made from a message that was published, so its origin has history,
-- but for the moment between that publish and its finalize's commit (see
-- deferred_lineage.sql): a re-deferral stored then is missing here until
-- its origin's 'published' row commits, milliseconds later. Its lineage
-- is right all the same, and so is every row the history keeps.
--
-- id is the history row's; an unfolded deferral has the id of the
-- 'published' row it was folded into, and a pending message's deferral has
-- none. In the order of the events: ORDER BY recorded_at, id NULLS LAST,
-- event <> 'deferred' (history.sql; deferred_history.sql says why).
-- Columns as deferred_history's.

CREATE OR REPLACE FUNCTION deferred_lineage_history(lineage bigint)
RETURNS TABLE (id bigint, lineage_id bigint, message_id bigint, event text, attempt int, reason text,
               error_class text, error_message text, target_topic text, next_run_at timestamptz,
               recorded_at timestamptz, partition int, record_offset bigint, actor text)
LANGUAGE sql STABLE AS $$
    SELECT a.id, a.lineage_id, a.message_id, a.event, a.attempt, a.reason,
           CASE WHEN a.deferred_at IS NULL THEN a.error_class END,
           CASE WHEN a.deferred_at IS NULL THEN a.error_message END,
           a.target_topic, a.next_run_at, a.recorded_at, a.partition, a.record_offset, a.actor
    FROM deferred_attempt a
    WHERE a.lineage_id = deferred_lineage_history.lineage
    UNION ALL
    SELECT a.id, a.lineage_id, a.message_id, 'deferred', a.attempt - 1, NULL, a.error_class, a.error_message,
           a.target_topic, a.next_run_at, a.deferred_at, NULL, NULL, NULL
    FROM deferred_attempt a
    WHERE a.lineage_id = deferred_lineage_history.lineage AND a.deferred_at IS NOT NULL
    UNION ALL
    SELECT NULL, deferred_lineage_history.lineage, m.id, 'deferred', m.attempt, m.reason, m.error_class,
           m.error_message, m.target_topic, m.next_run_at, m.created_at, NULL, NULL, NULL
    FROM deferred_message m
    WHERE (m.id = deferred_lineage_history.lineage
           OR m.origin_id = deferred_lineage_history.lineage
           OR m.origin_id = ANY (ARRAY(SELECT a.message_id FROM deferred_attempt a
                                       WHERE a.lineage_id = deferred_lineage_history.lineage)))
      AND m.state = 'pending' AND NOT m.gated
      AND NOT EXISTS (SELECT FROM deferred_attempt a WHERE a.message_id = m.id)
      AND deferred_lineage(m.id) = deferred_lineage_history.lineage
$$;
