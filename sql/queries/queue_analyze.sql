-- Analyze deferred_message and deferred_key if the planner's estimate of
-- their rows is far below what they hold (see deferred_queue_analyze in
-- migration 0003). $1 is the fewest rows worth an ANALYZE. Returns the
-- tables analyzed.
SELECT deferred_queue_analyze($1::bigint) AS analyzed
