-- The console scenario's seed, step 4 (cmd/bench/console.go): the history
-- the triggers wrote for live messages $1..$2 is dated when it happened,
-- not when the seed ran: the 'deferred' (or 'parked', 'rejected') event of
-- a message's storing at its created_at, a later park a minute after.
-- Otherwise a million events would fall in the last minutes, and the
-- overview's count of recent deliveries (the recent end of deferred_attempt)
-- would read them all.
UPDATE deferred_attempt a
SET recorded_at = m.created_at + CASE WHEN a.id = f.first_id THEN interval '0' ELSE interval '1 minute' END
FROM deferred_message m
CROSS JOIN LATERAL (SELECT min(b.id) AS first_id FROM deferred_attempt b WHERE b.message_id = m.id) f
WHERE m.id BETWEEN $1::bigint AND $2::bigint
  AND a.message_id = m.id
