-- Finalize, last step for unordered messages: give back the heads $1
-- (head_id, business_key NULL) leased to $2, back off those in $3 from $4
-- up to $5; dispatch_release.sql, which releases business keys, says the
-- rest. An operator's statement may move such a head meanwhile (its due
-- time, its target): the plain UPDATE re-checks the new version and still
-- releases it. "(business_key IS NULL) IS TRUE" selects the same heads
-- as "business_key IS NULL" but is no condition on deferred_key_business_key:
-- with stale statistics the planner ANDed in a scan of every unordered
-- head's entry there (docs/design.md section 14).
UPDATE deferred_key
SET leased_by = NULL,
    failures = CASE WHEN head_id = ANY ($3::bigint[]) THEN failures + 1 ELSE 0 END,
    leased_until = CASE WHEN head_id = ANY ($3::bigint[])
                        THEN now() + least($5::interval, $4::interval * power(2, least(failures, 30)))
                   END
WHERE leased_by = $2::text AND (business_key IS NULL) IS TRUE AND head_id = ANY ($1::bigint[])
