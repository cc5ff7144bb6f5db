-- A message's deferral is written to the history only when something else
-- happens to it: ingest no longer writes a 'deferred' row for every
-- message it stores pending (docs/design.md section 3.5).
--
-- Nearly every message is stored pending and then delivered, and its
-- history was two rows: 'deferred' at ingest and 'published' at finalize,
-- each with four index entries. While it waits, its row in
-- deferred_message records the deferral already. Now the 'published' row
-- records both (deferred_at: when it was stored; error_class,
-- error_message: why), and anything else that happens to a message first
-- (an operator's update or delete, a park) writes the deferral as a row of
-- its own before its event. Measured before building it: 14% more end to
-- end and a fifth more ingest (docs/benchmarks.md, "Without the 'deferred'
-- history row").
--
-- What operators see: deferred_attempt has no 'deferred' row for a message
-- still pending that nothing happened to, nor for one delivered without
-- anything else happening to it; the view deferred_history has every
-- event, unfolded, and history.sql, show_message.sql, `scheduler show` and
-- the console read through deferred_lineage_history. 'gated', 'parked' and
-- 'rejected' deferrals are still rows of their own from the start.
--
-- Changes sql/schema/functions/deferred_attempt_after_insert.sql: rows only
-- for messages stored parked, rejected or gated.
-- Changes sql/schema/functions/deferred_attempt_after_update.sql and
-- sql/schema/functions/deferred_attempt_after_delete.sql: the deferral of
-- a message without history first, from the row as it was.
-- Adds sql/schema/functions/deferred_lineage.sql (the lineage of a
-- message), sql/schema/functions/deferred_lineage_history.sql (a lineage's
-- events, by index) and sql/schema/views/deferred_history.sql (every
-- event).
--
-- Upgrading: a replica still on the previous release publishes without
-- folding, so a message stored by an upgraded replica and delivered by an
-- old one, during the rolling upgrade, has its 'published' event but no
-- 'deferred' one. Messages stored before this migration keep their
-- 'deferred' rows and are delivered as before.
--
-- The re-deferrals of a message were found through the history, which no
-- longer has them while they wait: deferred_message_origin finds them by
-- origin_id. Partial, so that a first deferral (no origin) costs it
-- nothing. CREATE INDEX reads the whole of deferred_message and blocks
-- writes to it meanwhile: about a second per million messages.
ALTER TABLE deferred_attempt ADD COLUMN deferred_at timestamptz;

COMMENT ON TABLE deferred_attempt IS
    'History of every message lineage: deferrals, parks, rejections, replays, expedites, cancels and deliveries, and who acted. Written by triggers on deferred_message and by dispatch''s finalize; pruned after HISTORY_RETENTION. A deferral followed only by its delivery is folded into the published row (deferred_at): read the view deferred_history for every event.';

CREATE INDEX deferred_message_origin ON deferred_message (origin_id) WHERE origin_id IS NOT NULL;
