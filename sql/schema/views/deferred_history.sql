-- deferred_history: every event of every message, as an operator reads the
-- history: deferred_attempt's rows, with the deferrals that are not rows
-- of their own made into rows (migration 0012). A message stored pending
-- and left alone has no history row: its deferral reaches the history with
-- the first thing that happens to it, folded into its 'published' row
-- (deferred_attempt.deferred_at) when that is its delivery. So this view
-- is deferred_attempt's rows (a 'published' row without the deferral's
-- error, which is not its own), plus a 'deferred' row for each folded
-- deferral (at deferred_at, with the id of its 'published' row), plus a
-- 'deferred' row for each message still pending with no history row (no
-- id; its lineage as deferred_lineage names it). Columns as
-- deferred_attempt's, but deferred_at. Order events by recorded_at, id
-- NULLS LAST, event <> 'deferred': a deferral written late (folded, or
-- before a later event) has a later id than events that came after it,
-- but is recorded at when it happened.
--
-- Reading one message (WHERE message_id = ...) reads indexes. Reading one
-- lineage (WHERE lineage_id = ...) reads every pending message for the
-- last part: use deferred_lineage_history(deferred_lineage(id)) instead.
--
-- CREATE OR REPLACE VIEW keeps the view's grants, but can only add columns
-- at the end: to drop, rename or retype one, drop the view in a numbered
-- migration (which re-applies this file after it).

CREATE OR REPLACE VIEW deferred_history AS
SELECT a.id, a.lineage_id, a.message_id, a.event, a.attempt, a.reason,
       CASE WHEN a.deferred_at IS NULL THEN a.error_class END AS error_class,
       CASE WHEN a.deferred_at IS NULL THEN a.error_message END AS error_message,
       a.target_topic, a.next_run_at, a.recorded_at, a.partition, a.record_offset, a.actor
FROM deferred_attempt a
UNION ALL
SELECT a.id, a.lineage_id, a.message_id, 'deferred', a.attempt - 1, NULL, a.error_class, a.error_message,
       a.target_topic, a.next_run_at, a.deferred_at, NULL, NULL, NULL
FROM deferred_attempt a
WHERE a.deferred_at IS NOT NULL
UNION ALL
SELECT NULL, deferred_lineage(m.id),
       m.id, 'deferred', m.attempt, m.reason, m.error_class, m.error_message, m.target_topic, m.next_run_at,
       m.created_at, NULL, NULL, NULL
FROM deferred_message m
WHERE m.state = 'pending' AND NOT m.gated
  AND NOT EXISTS (SELECT FROM deferred_attempt a WHERE a.message_id = m.id);
