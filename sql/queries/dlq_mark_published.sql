-- The broker acknowledged the dead-letter copies of messages $1 (bigint[]),
-- leased with dlq_claim.sql, which returned $2 (timestamptz[], parallel to
-- $1) as their parked_at. Marks them sent and ends their lease, but only
-- rows still in the same stay in the parking lot: a row an operator replayed
-- meanwhile is no longer parked, and one replayed and parked again has a new
-- parked_at; its new stay gets a copy of its own (leaving the parking lot
-- reset dlq_published_at and the lease, see deferred_message_touch). Returns
-- the ids marked.
-- The id = ANY bound lets an index scan find the rows whatever the
-- statistics say (see migration 0003).
UPDATE deferred_message m
SET dlq_published_at = now(), dlq_leased_until = NULL
FROM unnest($1::bigint[], $2::timestamptz[]) AS p (id, parked_at)
WHERE m.id = ANY ($1::bigint[]) AND m.id = p.id AND m.state = 'parked' AND m.parked_at = p.parked_at AND m.dlq_published_at IS NULL
RETURNING m.id
