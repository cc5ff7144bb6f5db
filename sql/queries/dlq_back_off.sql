-- Dead-letter copies of messages $1 (bigint[]), leased with dlq_claim.sql
-- with parked_at $2 (timestamptz[]), failed to publish: keep each leased for
-- its back-off, $3 (interval[], parallel), so that no publisher of any
-- process retries it before, while other copies go on. Rows that left that
-- stay in the parking lot meanwhile are left alone, as by
-- dlq_mark_published.sql.
-- The id = ANY bound lets an index scan find the rows whatever the
-- statistics say (see migration 0003).
UPDATE deferred_message m
SET dlq_leased_until = now() + p.back_off
FROM unnest($1::bigint[], $2::timestamptz[], $3::interval[]) AS p (id, parked_at, back_off)
WHERE m.id = ANY ($1::bigint[]) AND m.id = p.id AND m.state = 'parked' AND m.parked_at = p.parked_at AND m.dlq_published_at IS NULL
