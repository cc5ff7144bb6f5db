-- Finalize, step 3: give back the keys $1 (business keys) and $2 (unordered
-- heads) leased to $3. Keys in $4 (business keys) and $6 (unordered heads)
-- failed with a retriable error: they stay leased to no one until now() + $5,
-- which is how dispatch backs off from a broker that is down without holding
-- a transaction or a worker.
UPDATE deferred_key
SET leased_by = NULL,
    leased_until = CASE WHEN business_key = ANY ($4::text[]) OR (business_key IS NULL AND head_id = ANY ($6::bigint[]))
                        THEN now() + $5::interval END
WHERE leased_by = $3::text
  AND (business_key = ANY ($1::text[]) OR (business_key IS NULL AND head_id = ANY ($2::bigint[])))
