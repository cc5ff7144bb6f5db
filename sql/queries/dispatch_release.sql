-- Finalize, last step: give back the keys $1 (business keys) and $2
-- (unordered heads) leased to $3, after the messages were deleted or parked
-- (see internal/keylock's Finalize); a key the delete leased 'in-flight'
-- stays so. Keys in $4 (business keys) and $5
-- (unordered heads) failed with a retriable error: they stay leased to no one
-- for a back-off that doubles with each consecutive failure, from $6 up to
-- $7, which is how dispatch backs off from a broker that is down without
-- holding a transaction or a worker. A key that published resets its count.
--
-- Deliberately one plain UPDATE with no self-join: a row updated by someone
-- else meanwhile (an operator's statement moving an unordered head) is then
-- re-checked on its new version and still released. A join on ctid would
-- silently skip it, leaking the lease.
UPDATE deferred_key
SET leased_by = NULL,
    failures = CASE WHEN business_key = ANY ($4::text[]) OR (business_key IS NULL AND head_id = ANY ($5::bigint[]))
                    THEN failures + 1 ELSE 0 END,
    leased_until = CASE WHEN business_key = ANY ($4::text[]) OR (business_key IS NULL AND head_id = ANY ($5::bigint[]))
                        THEN now() + least($7::interval, $6::interval * power(2, least(failures, 30)))
                   END
WHERE leased_by = $3::text
  AND (business_key = ANY ($1::text[]) OR (business_key IS NULL AND head_id = ANY ($2::bigint[])))
